#!/usr/bin/env python
"""The GPU check (issues 12, 28): one run on one GPU that exercises and measures the whole
stack in a fixed time, and prints one summary table. Run it through ``tools/gpu_check.sh``
(which installs the carried megatron-core wheel when the machine lacks it, and times that):

    bash tools/gpu_check.sh [--smoke] [--out DIR] [--budget-s S] [--no-cuda-graphs]

Stages, in this order (each timed; an error fails its stage only, later stages still run):

  install      (a row) the seconds gpu_check.sh spent installing the carried wheels
  convert      a random HF ``LlamaForCausalLM`` (seeded; weights rounded to bf16 values, so
               the fp32 and bf16 models hold the same numbers) saved as HF safetensors with
               the tokenizer, converted with ``tools/convert_checkpoint.py hf-to-mcore``
  ppo, grpo    ``torchrun -m megatron_rlhf.train`` iterations: per-stage time, peak memory
  greedy       our generator == ``transformers`` greedy, fp32 (TF32 off); a divergence
               passes only at a near-tie (HF's logit of our token within 1e-3 of its max)
  decode_bf16  bf16 logits of the graphed decode step (``graphs.StepGraphs``: a CUDA graph of
               ``forward_cached(static=True)``; run eagerly on CPU or with --no-cuda-graphs),
               and of the dynamic step, == the whole-sequence forward, relative error <= 3e-2
  bench        bf16 sampling (T=1, no top-k/top-p), EOS ignored: ours vs HF ``generate``
               at several batch sizes: tok/s, ms per decode step, ratio
  verify       ms of a cached forward of 5 tokens vs 1 token per sample
               (``megatron_rlhf.generation.graphs.time_step``; eager fallback)
  speculative  the actor as its own draft: greedy speculative (n=4) == greedy plain (fp32),
               accepted length and tok/s vs plain (bf16), and what ``auto`` chooses
  padded       logits of a left-padded batch == each sequence alone (fp32 and bf16), and
               the control: without the mask they differ

Time: ``--budget-s`` (default 420 on the 1b shape, counting the install; none with
``--smoke``). The training stages run before the decode stages, so when time runs short
it is decode stages that are left out: one with less than its minimum left is SKIPPED
(reported in the table and ``summary.json``'s ``skipped_for_time``; the check still
passes), and bench and speculative drop their larger batches. A setup or training stage
that cannot start fails. A watchdog writes the summary and ends a hung run 30 s after the
budget. ``--no-cuda-graphs``: every generating stage decodes eagerly (the header says
which). The header also gives torch, CUDA and cuDNN versions and the decode attention
backend (on CUDA with the SDPA kernel torch takes for a bf16 decode step of the model).

``--smoke`` runs tiny shapes (hidden 64, 2 layers) on whatever device there is (CPU here),
so the script is tested end to end before GPU time is spent on it. Output: the table on
stdout, and in ``--out``: ``summary.json``, ``measurements.jsonl`` (every measurement),
``table.txt``, ``ppo_metrics.jsonl``, ``grpo_metrics.jsonl``, ``logs.txt`` (the
subprocesses' output). Checkpoints go to ``--work`` (not ``--out``: they are large).
Exit status: 0 when every stage passed (or was skipped), 1 otherwise. Goals (speed
targets) are reported as met / not met and do not change the exit status.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_support import (  # noqa: E402
    CheckFailed,
    GOALS,
    NEAR_TIE,
    Report,
    SHAPES,
    _capture_note,
    _eager_time_step,
    _fallback_tokenizer,
    _hf_no_eos,
    _hf_sample_time,
    _llama_config,
    _release,
    _tokenizer_from_dir,
    _decode_attention,
    _versions,
    fmt,
)

PLAN = (
    # (stage, group, minimum seconds left to start it), in the order they run: training
    # before the decode stages, so a short budget leaves out decode stages (SKIP), never
    # training (a setup or training stage that cannot start FAILs)
    ("convert", "setup", 60),
    ("ppo", "train", 60),
    ("grpo", "train", 60),
    ("greedy", "decode", 20),
    ("decode_bf16", "decode", 10),
    ("bench", "decode", 60),
    ("verify", "decode", 10),
    ("speculative", "decode", 30),
    ("padded", "decode", 10),
)
STAGES = tuple(name for name, _, _ in PLAN)
DECODE_TOLERANCE = 3e-2
"""bf16 decode logits vs the whole-sequence forward, relative to the largest logit (as in
tests/unit/test_decode_attention.py)."""
OUT_FILES = ("summary.json", "measurements.jsonl", "table.txt", "logs.txt", "ppo_metrics.jsonl",
             "grpo_metrics.jsonl")

# ---------------------------------------------------------------------------- the check
def _import_error(module: str) -> str:
    """Why ``module`` does not import, or ''."""
    try:
        __import__(module)
        return ""
    except Exception as e:  # noqa: BLE001
        return (f"{module} does not import ({type(e).__name__}: {e}): run tools/gpu_prepare.sh where "
                "the package registries are reachable and carry .whl (device tool: carry "
                "[\".whl\"])")[:400]


def _capture_failures(gen) -> str:
    """Why a generator's CUDA graph captures failed (it then decodes eagerly), or ''."""
    steps = getattr(gen, "_steps", {}) or {}
    return "; ".join(f"{name}: {g.failed}" for name, g in steps.items() if getattr(g, "failed", None))


class Check:
    def __init__(self, args):
        self.args = args
        self.smoke = args.smoke
        self.shape = SHAPES["smoke" if args.smoke else "1b"]
        self.dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.cuda = self.dev.type == "cuda"
        self.out = Path(args.out).resolve()
        self.work = Path(args.work).resolve() if args.work else Path(
            tempfile.mkdtemp(prefix="gpu_check_"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.hf_dir, self.ckpt = self.work / "hf", self.work / "ckpt"
        # the install (before this process) counts against the budget
        self.deadline = (time.perf_counter() + args.budget_s - (args.install_s or 0.0)
                         if args.budget_s else None)
        self.graphs = bool(args.cuda_graphs)  # generating stages replay CUDA graphs (on CUDA)
        self.blocked = _import_error("megatron.core")  # no stage can run without it
        self.tokenizer = None
        self.tokenizer_source = None
        self.pg = None
        self.models: dict = {}
        self.hf: dict = {}
        self.report: Report | None = None
        self.current = None

    # ------------------------------------------------------------------ helpers
    def remaining(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.perf_counter()

    @property
    def graph_state(self) -> str:
        if not self.cuda:
            return "none (cpu)"
        return "on" if self.graphs else "off (--no-cuda-graphs)"

    def enough(self, seconds: float) -> bool:
        """Whether ``seconds`` are left of the budget (decode stages drop their larger
        batches when not)."""
        return self.remaining() >= seconds

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def env(self) -> dict:
        path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1")

    def run_cmd(self, name: str, cmd: list[str], timeout: float) -> int:
        """Run ``cmd`` in its own process group, output appended to ``logs.txt``; returns
        its exit code (raises CheckFailed on timeout, after killing the group)."""
        logs = self.out / "logs.txt"
        with logs.open("a") as f:
            f.write(f"\n===== {name} command: {' '.join(cmd)}\n")
            f.flush()
            p = subprocess.Popen(cmd, cwd=ROOT, env=self.env(), stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            try:
                code = p.wait(timeout=max(timeout, 1))
            except subprocess.TimeoutExpired:
                code = None
            finally:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # its group: leftovers (checkpoint writers)
                except ProcessLookupError:
                    pass
                p.wait()
            f.write(f"===== {name} exit status: {code}\n")
        if code is None:
            raise CheckFailed(f"timed out after {timeout:.0f} s (see logs.txt)")
        return code

    def last_error(self, name: str) -> str:
        """The error lines of subprocess ``name``'s output in ``logs.txt`` (our ``error:``
        messages and exception lines), else its last lines."""
        logs = self.out / "logs.txt"
        text = logs.read_text() if logs.exists() else ""
        part = text[text.rfind(f"===== {name} command: "):].splitlines()[1:-1]
        errors = [x.strip() for x in part if re.match(r"^\s*(error:|[\w.]*(Error|Exception)\b)", x)]
        return " | ".join((errors or [x.strip() for x in part if x.strip()])[-3:])[:400]

    # ------------------------------------------------------------------ tokenizer
    def load_tokenizer(self):
        if self.tokenizer is not None:
            return self.tokenizer
        d = Path(self.args.tokenizer) if self.args.tokenizer else ROOT / ".whl" / "tokenizer"
        if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file():
            self.tokenizer, self.tokenizer_source = _tokenizer_from_dir(d), str(d)
        elif not self.smoke:
            raise CheckFailed(f"no tokenizer in {d}: run tools/gpu_prepare.sh on a machine with "
                              "the package registries and carry .whl, or pass --tokenizer DIR")
        else:
            self.tokenizer, self.tokenizer_source = _fallback_tokenizer()
        return self.tokenizer

    @property
    def pad_id(self) -> int:
        t = self.load_tokenizer()
        return t.pad_token_id if t.pad_token_id is not None else 0

    def prompts(self, n: int, split: str = "train") -> list[list[int]]:
        """``n`` prompt id lists from the shipped prompt set (chat-formatted when the
        tokenizer has a chat template), cycling when ``n`` exceeds the split."""
        from megatron_rlhf.data.prompts import load_prompts
        from megatron_rlhf.data.tokenizer import encode_prompt

        tok = self.load_tokenizer()
        chat = bool(getattr(tok, "chat_template", None))
        texts = [p.prompt for p in load_prompts(split=split)]
        if not chat:  # the char tokenizer knows lowercase letters only
            texts = ["".join(c for c in t.lower() if c.isalpha())[:24] or "abc" for t in texts]
        distinct = [encode_prompt(tok, t, chat=chat) for t in texts[: min(n, len(texts))]]
        return [distinct[i % len(distinct)] for i in range(n)]

    # ------------------------------------------------------------------ models
    def init_dist(self):
        if self.pg is None:
            from megatron_rlhf import platform
            from megatron_rlhf.parallel.groups import build_process_groups
            from megatron_rlhf.parallel.layout import Layout

            platform.quiet_third_party_warnings()
            platform.init_distributed(seed=self.args.seed)
            self.pg = build_process_groups(Layout())
        return self.pg

    def need_ckpt(self) -> Path:
        from megatron_rlhf.models.checkpoint import read_checkpoint

        try:
            read_checkpoint(self.ckpt)
        except Exception as e:
            raise CheckFailed(f"no converted checkpoint ({e})") from None
        return self.ckpt

    def model(self, dtype: torch.dtype, role: str = "actor"):
        """Our model of ``role`` in ``dtype`` from the converted checkpoint (cached)."""
        key = (dtype, role)
        if key not in self.models:
            from megatron_rlhf.models.builder import build_model
            from megatron_rlhf.models.checkpoint import load_checkpoint, read_checkpoint

            pg = self.init_dist()
            info = read_checkpoint(self.need_ckpt())
            m = build_model(info.config, role, pg, dtype=dtype, seed=self.args.seed)
            load_checkpoint(m, pg, info.path)
            m.eval()
            self.models[key] = m
        return self.models[key]

    def hf_model(self, dtype: torch.dtype):
        if dtype not in self.hf:
            from transformers import LlamaForCausalLM

            if not (self.hf_dir / "config.json").is_file():
                raise CheckFailed("no HF checkpoint (the convert stage failed)")
            m = LlamaForCausalLM.from_pretrained(str(self.hf_dir), dtype=dtype)
            self.hf[dtype] = _hf_no_eos(m.to(self.dev).eval())
        return self.hf[dtype]

    def free(self) -> None:
        self.models.clear()
        self.hf.clear()
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ running stages
    def functions(self) -> dict:
        """Each stage of :data:`PLAN`: a function of the stage's detail rows -> its summary."""
        return {"convert": self.st_convert, "ppo": lambda rows: self.st_train(rows, "ppo"),
                "grpo": lambda rows: self.st_train(rows, "grpo"), "greedy": self.st_greedy,
                "decode_bf16": self.st_decode_bf16, "bench": self.st_bench, "verify": self.st_verify,
                "speculative": self.st_speculative, "padded": self.st_padded}

    def record_install(self) -> None:
        """The ``install`` row: what ``gpu_check.sh`` installed and how long it took."""
        a = self.args
        row = {"name": "install", "status": "PASS", "seconds": a.install_s or 0.0, "rows": [],
               "details": (f"into .whl/site: {a.installed}" if a.installed else
                           "nothing to install (every carried wheel imports, or no .whl/)")}
        errors = [e for e in (a.install_error, self.blocked) if e]
        if errors:
            row.update(status="FAIL", details="; ".join(errors))
        elif a.install_s is None:
            row.update(status="SKIP", details="not measured: run through tools/gpu_check.sh")
        self.report.stages.append(row)
        self.report.save()

    def run(self, functions: dict | None = None) -> None:
        """Every stage of :data:`PLAN` in order (``functions``: name -> function, default
        :meth:`functions`)."""
        functions = functions or self.functions()
        for name, group, min_s in PLAN:
            self.stage(name, functions[name], min_s, group)

    def stage(self, name: str, fn, min_s: float = 5.0, group: str = "decode") -> None:
        rep = self.report
        row = {"name": name, "status": "FAIL", "seconds": 0.0, "details": "", "rows": []}
        rep.stages.append(row)
        left = self.remaining()
        if name not in self.args.stages:
            row.update(status="SKIP", details="not selected (--stages)")
        elif self.blocked:
            row.update(status="SKIP", details="not run: megatron.core does not import")
        elif left < min_s:
            why = (f"{max(left, 0):.0f} s left of the {self.args.budget_s:g} s budget, "
                   f"the stage needs {min_s:g} s")
            if group == "decode":  # decode stages yield the time to training: not a failure
                row.update(status="SKIP", skipped="time", details=f"skipped for time: {why}")
            else:
                row.update(details=f"not run: {why}")
        if row["details"]:
            rep.save()
            self.log(f"--- stage {name}: {row['status']}: {row['details']}")
            return
        self.current = row
        self.log(f"--- stage {name}")
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            details = fn(row["rows"])
            row.update(status="PASS", details=details)
        except CheckFailed as e:
            row.update(details=str(e))
        except Exception as e:  # noqa: BLE001 - every error fails its own stage only
            tb = traceback.format_exc()
            self.log(tb)
            row.update(details=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300],
                       error=tb)
        row["seconds"] = time.perf_counter() - t0
        if self.cuda:  # this process's peak (the training stages run in their own)
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
            if group != "train":
                row["details"] += f"; peak {row['peak_mem_gb']:.1f} GiB"
        self.current = None
        rep.save()
        self.log(f"--- stage {name}: {row['status']} in {row['seconds']:.1f} s: {row['details']}")

    # ------------------------------------------------------------------ 1. convert
    def st_convert(self, rows) -> str:
        from transformers import LlamaConfig, LlamaForCausalLM

        s = self.shape
        tok = self.load_tokenizer()
        rows.append(("tokenizer", f"{self.tokenizer_source} ({len(tok)} tokens)"))
        shutil.rmtree(self.hf_dir, ignore_errors=True)
        shutil.rmtree(self.ckpt, ignore_errors=True)
        cfg = _llama_config(LlamaConfig, vocab=len(tok), hidden=s.hidden, layers=s.layers,
                            heads=s.heads, kv_heads=s.kv_heads, ffn=s.ffn, positions=s.positions,
                            bos=tok.bos_token_id, eos=tok.eos_token_id, pad=self.pad_id)
        t0 = time.perf_counter()
        torch.manual_seed(self.args.seed)
        with torch.device(self.dev):
            hf = LlamaForCausalLM(cfg)
        with torch.no_grad():
            for p in hf.parameters():  # bf16 values: the fp32 and bf16 models hold the same numbers
                p.copy_(p.to(torch.bfloat16).float())
        n_params = sum(p.numel() for p in hf.parameters())
        hf.save_pretrained(str(self.hf_dir))
        tok.save_pretrained(str(self.hf_dir))
        self.sync()
        t_hf = time.perf_counter() - t0
        self.hf[torch.float32] = _hf_no_eos(hf.eval())
        size = sum(f.stat().st_size for f in self.hf_dir.glob("*.safetensors"))
        rows.append(("HF init + save_pretrained", f"{t_hf:.1f} s, {size / 1e9:.2f} GB safetensors (fp32)"))
        t0 = time.perf_counter()
        code = self.run_cmd("convert", [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"),
                                        "hf-to-mcore", "--input", str(self.hf_dir),
                                        "--output", str(self.ckpt)],
                            timeout=min(300, self.remaining()))
        t_conv = time.perf_counter() - t0
        if code != 0:
            raise CheckFailed(f"convert_checkpoint.py exited {code}: {self.last_error('convert')}")
        from megatron_rlhf.models.checkpoint import read_checkpoint

        info = read_checkpoint(self.ckpt)
        c = info.config
        ck = sum(f.stat().st_size for f in info.path.rglob("*") if f.is_file())
        rows.append(("convert_checkpoint.py hf-to-mcore", f"{t_conv:.1f} s (subprocess), {ck / 1e9:.2f} GB"))
        self.report.measure("convert", params=n_params, hf_s=t_hf, convert_s=t_conv,
                            hf_bytes=size, ckpt_bytes=ck)
        return (f"{n_params / 1e9:.3g}B params: {c.num_layers} layers, hidden {c.hidden_size}, "
                f"{c.num_attention_heads}/{c.num_query_groups} heads, ffn {c.ffn_hidden_size}, "
                f"vocab {c.vocab_size}, tied {c.tie_embeddings}")

    # ------------------------------------------------------------------ 2. greedy
    def st_greedy(self, rows) -> str:
        from megatron_rlhf.config import GenerationConfig, SpecConfig
        from megatron_rlhf.generation.engine import Generator

        n = self.shape.greedy_new
        prompts = self.prompts(4, split="heldout")
        actor = self.model(torch.float32)
        r = Generator(actor, pad_id=self.pad_id).generate(
            prompts, GenerationConfig(max_new_tokens=n, temperature=0.0, stop_on_eos=False,
                                      cuda_graphs=self.graphs), SpecConfig(0))
        ours = [r.response_ids[i, : int(r.lengths[i])].tolist() for i in range(len(prompts))]
        hf = self.hf_model(torch.float32)
        equal, ties, bad = 0, [], []
        for i, p in enumerate(prompts):
            ids = torch.tensor([p], device=self.dev)
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=n, output_logits=True, return_dict_in_generate=True,
                                  pad_token_id=self.pad_id)
            ref = out.sequences[0, len(p):].tolist()
            if len(ref) != n or len(ours[i]) != n:
                raise CheckFailed(f"prompt {i}: lengths ours {len(ours[i])}, HF {len(ref)}, want {n}")
            j = next((k for k in range(n) if ours[i][k] != ref[k]), None)
            self.report.measure("greedy", prompt=i, prompt_len=len(p), ours=ours[i], hf=ref,
                                first_divergence=j)
            if j is None:
                equal += 1
                continue
            logits = out.logits[j][0].float()
            top2 = logits.topk(2).values
            margin = float(top2[0] - top2[1])
            gap = float(logits.max() - logits[ours[i][j]])
            what = (f"prompt {i} token {j}: ours {ours[i][j]}, HF {ref[j]}, HF top-2 margin "
                    f"{margin:.2e}, HF gap to ours {gap:.2e}")
            rows.append(("divergence", what))
            (ties if gap < NEAR_TIE else bad).append(what)
        summary = f"{len(prompts)} prompts x {n} tokens, fp32: {equal} equal"
        if ties:
            summary += f", {len(ties)} diverge at a near-tie (gap < {NEAR_TIE:g})"
        if bad:
            raise CheckFailed(summary + f", {len(bad)} DIVERGE beyond a near-tie: {bad[0]}")
        self.hf.pop(torch.float32, None)
        return summary

    # ------------------------------------------------------------------ 2b. bf16 decode logits
    def st_decode_bf16(self, rows) -> str:
        """Rows of different lengths prefilled into a :class:`graphs.StepGraphs` store, then
        decode steps and verifications of several widths replayed from its graphs (the
        captured ``forward_cached(static=True)``; eager on CPU or with --no-cuda-graphs), and
        the same through the dynamic step: each step's logits against ``lm_logits`` of the
        whole sequence, bf16, error = max |diff| / max |ref|."""
        from megatron_rlhf.generation import graphs, incremental as inc
        from megatron_rlhf.generation.kv_cache import KVCache
        from megatron_rlhf.models.forward import lm_logits

        model = self.model(torch.bfloat16)
        lens, widths = (5, 17, 40), (1, 5, 1, 3, 2, 1, 5, 1)  # 3 rows: a padded bucket of 4
        max_len = max(lens) + sum(widths)
        g = torch.Generator().manual_seed(self.args.seed)
        vocab = len(self.load_tokenizer())
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
        feeds = [torch.randint(3, vocab, (len(lens), n), generator=g) for n in widths]
        graphed = self.cuda and self.graphs and graphs.graphable(model)
        runner = graphs.StepGraphs(model, len(lens), max_len, capture=graphed)
        rope = inc.RopeTable(model, max_len)
        errors, tol = {}, DECODE_TOLERANCE
        with torch.inference_mode():
            for way in ("graphed", "dynamic"):
                if way == "graphed":
                    cache, step = runner.new_cache(len(lens)), runner
                else:
                    cache = KVCache.for_model(model, len(lens), max_len)
                    step = lambda t, c=cache: inc.forward_cached(model, c, t, rope)  # noqa: E731
                inc.prefill(model, cache, prompts, rope)
                seqs, worst = [list(p) for p in prompts], 0.0
                for toks in feeds:
                    toks = toks.to(self.dev)
                    out = step(toks)
                    for b, sq in enumerate(seqs):
                        sq += toks[b].tolist()
                        ref = lm_logits(model, torch.tensor([sq], device=self.dev))[0, -toks.shape[1]:].float()
                        worst = max(worst, float((out[b].float() - ref).abs().max() / ref.abs().max()))
                errors[way] = worst
        capture, failed = runner.capture_s, getattr(runner, "failed", None)
        del runner, cache, step
        how = ("CUDA graphs" if graphed else "eager: " + ("--no-cuda-graphs" if self.cuda and not self.graphs
                                                          else "not graphable" if self.cuda else "cpu"))
        backend = self.report.header.get("decode_attention", "?")
        for way, err in errors.items():
            label = f"graphed step ({how})" if way == "graphed" else "dynamic step (forward_cached)"
            self.report.measure("decode_bf16", way=way, graphed=graphed, rel_err=err, tolerance=tol,
                                lengths=list(lens), widths=list(widths), backend=backend)
            note = _capture_note(capture) if way == "graphed" and graphed else ""
            rows.append((label, f"rel err {err:.2e} (tol {tol:g}){note}"))
        bad = [f"{w} {e:.2e}" for w, e in errors.items() if not e <= tol]
        if failed:
            rows.append(("CUDA graph capture FAILED", f"{failed} (the step ran eagerly)"[:300]))
            raise CheckFailed(f"CUDA graph capture failed: {failed}"[:300])
        if bad:
            raise CheckFailed(f"bf16 decode logits != whole-sequence forward beyond rel {tol:g}: "
                              + ", ".join(bad) + f"; attention {backend}")
        return (f"bf16, rows of {lens} tokens then steps of {widths} tokens vs lm_logits, rel tol "
                f"{tol:g}; attention {backend}")

    # ------------------------------------------------------------------ 3. bench
    def st_bench(self, rows) -> str:
        from megatron_rlhf.config import GenerationConfig, SpecConfig
        from megatron_rlhf.generation.engine import Generator

        s = self.shape
        dtype = torch.bfloat16
        actor = self.model(dtype)
        hf = self.hf_model(dtype)
        cfg = GenerationConfig(max_new_tokens=s.bench_new, temperature=1.0, top_k=0, top_p=1.0,
                               stop_on_eos=False, cuda_graphs=self.graphs)
        results = {}
        last = 0.0  # seconds the previous batch size took (a larger one takes longer)
        for b in s.bench_batches:
            if results and not self.enough(2 * last + 10):
                rows.append((f"batch {b}", "not run: the time budget is short"))
                self.report.measure("bench", batch=b, skipped="time")
                continue
            start = time.perf_counter()
            prompts = self.prompts(b)
            gen = Generator(actor, pad_id=self.pad_id)
            # warm-up at full length: the generator keeps its KV store and CUDA graphs for
            # the next call when that call fits them (as across the iterations of a run)
            gen.generate(prompts, cfg, SpecConfig(0), seed=0)
            self.sync()
            t0 = time.perf_counter()
            r = gen.generate(prompts, cfg, SpecConfig(0), seed=1)
            self.sync()
            wall = time.perf_counter() - t0
            failed = _capture_failures(gen)
            _release(gen)
            st = r.stats
            capture = getattr(st, "graph_capture_s", None)
            if st.new_tokens != b * s.bench_new:
                raise CheckFailed(f"batch {b}: {st.new_tokens} tokens, want {b * s.bench_new}")
            ours_tok_s = st.new_tokens / wall
            step_ms = (st.elapsed_s - st.prefill_s) / max(st.actor_steps, 1) * 1e3
            hf_s = _hf_sample_time(hf, prompts, s.warm_new, s.bench_new, self.pad_id, self.dev,
                                   self.sync)
            hf_tok_s = b * s.bench_new / hf_s
            ratio = ours_tok_s / hf_tok_s
            results[b] = (ours_tok_s, step_ms, hf_tok_s, ratio)
            self.report.measure("bench", batch=b, new_tokens=s.bench_new, dtype="bf16",
                                ours_tok_s=ours_tok_s, ours_wall_s=wall, ours_step_ms=step_ms,
                                ours_prefill_s=st.prefill_s, ours_actor_steps=st.actor_steps,
                                ours_graph_capture_s=capture,
                                hf_tok_s=hf_tok_s, hf_wall_s=hf_s, ratio=ratio)
            rows.append((f"batch {b}", f"ours {ours_tok_s:.0f} tok/s ({step_ms:.2f} ms/step, prefill "
                                       f"{st.prefill_s * 1e3:.0f} ms{_capture_note(capture)}), "
                                       f"HF {hf_tok_s:.0f} tok/s, "
                                       f"ours/HF x{ratio:.2f}"))
            if failed:
                rows.append((f"batch {b}: CUDA graph capture FAILED", f"{failed} (decoded eagerly)"[:300]))
            self.log(f"bench batch {b}: {rows[-1][1]}")
            last = time.perf_counter() - start
        b1 = results.get(1)
        if b1:
            self.report.goal("decode step at batch 1 (ms)", b1[1], f"<= {GOALS['decode_step_ms_b1']}",
                             b1[1] <= GOALS["decode_step_ms_b1"])
            self.report.goal("ours/HF tok/s at batch 1", b1[3], f">= {GOALS['speedup_vs_hf_b1']}",
                             b1[3] >= GOALS["speedup_vs_hf_b1"])
        worst = min(results, key=lambda b: results[b][3])
        self.report.goal(f"ours/HF tok/s, worst batch ({worst})", results[worst][3],
                         f">= {GOALS['speedup_vs_hf_all']}",
                         results[worst][3] >= GOALS["speedup_vs_hf_all"])
        self.hf.pop(dtype, None)
        return (f"bf16, {s.bench_new} new tokens, T=1 sampling, EOS ignored; HF generate "
                f"({getattr(hf.config, '_attn_implementation', '?')} attention)")

    # ------------------------------------------------------------------ 3b. verification cost
    def st_verify(self, rows) -> str:
        s = self.shape
        actor = self.model(torch.bfloat16)
        how = set()
        worst = None
        for b in s.verify_batches:
            one, way = self.time_step(actor, b, 1, s.verify_context)
            five, _ = self.time_step(actor, b, 5, s.verify_context)
            how.add(way)
            ratio = five / one
            self.report.measure("verify", batch=b, context=s.verify_context, ms_1=one, ms_5=five,
                                ratio=ratio, method=way)
            rows.append((f"batch {b}", f"5 tokens {five:.3f} ms vs 1 token {one:.3f} ms: x{ratio:.2f} ({way})"))
            if b <= GOALS["verify_ratio_batch_max"]:
                worst = ratio if worst is None else max(worst, ratio)
        if worst is not None:
            self.report.goal(f"5-token / 1-token forward, batch <= {GOALS['verify_ratio_batch_max']}",
                             worst, f"<= {GOALS['verify_ratio_max']}", worst <= GOALS["verify_ratio_max"])
        return f"bf16, after {s.verify_context} cached tokens; timed by {', '.join(sorted(how))}"

    def time_step(self, model, batch: int, n: int, context: int, repeats: int = 20):
        """(ms per cached forward of ``n`` tokens per sample, how it was timed)."""
        try:
            from megatron_rlhf.generation import graphs
        except ImportError:
            graphs = None
        if graphs is None or not hasattr(graphs, "time_step"):
            return _eager_time_step(model, batch, n, context, repeats, self.sync), "eager fallback"
        graphed = self.cuda and self.graphs and getattr(graphs, "graphable", lambda m: False)(model)
        ms = float(graphs.time_step(model, batch, n, context, repeats=repeats, graphs=self.graphs))
        return ms, f"graphs.time_step, {'CUDA graph' if graphed else 'no graph'}"

    # ------------------------------------------------------------------ 4. speculative
    def st_speculative(self, rows) -> str:
        from megatron_rlhf.config import GenerationConfig, SpecConfig
        from megatron_rlhf.generation.engine import Generator

        s = self.shape
        greedy = GenerationConfig(max_new_tokens=s.spec_new, temperature=0.0, stop_on_eos=False,
                                  cuda_graphs=self.graphs)
        # equality, fp32: the actor is its own draft, so every draft token should be accepted
        a32, d32 = self.model(torch.float32), self.model(torch.float32, "draft")
        problems, notes = [], []
        for b in s.spec_batches:
            before = (len(problems), len(notes))
            prompts = self.prompts(b, split="heldout")
            plain = Generator(a32, pad_id=self.pad_id).generate(prompts, greedy, SpecConfig(0))
            spec = Generator(a32, d32, pad_id=self.pad_id).generate(prompts, greedy, SpecConfig(4))
            for i in range(b):
                x = plain.response_ids[i, : int(plain.lengths[i])].tolist()
                y = spec.response_ids[i, : int(spec.lengths[i])].tolist()
                j = next((k for k in range(min(len(x), len(y))) if x[k] != y[k]),
                         None if len(x) == len(y) else min(len(x), len(y)))
                if j is None:
                    continue
                gap = self._gap(a32, prompts[i] + x[:j], y[j] if j < len(y) else None)
                what = f"batch {b} sample {i} token {j}: gap {gap:.2e}"
                (notes if gap < NEAR_TIE else problems).append(what)
            acc = spec.stats.mean_accepted_length
            self.report.measure("speculative_equality", batch=b, dtype="fp32", new_tokens=s.spec_new,
                                mean_accepted_length=acc, rounds=spec.stats.actor_steps,
                                divergences=len(problems) + len(notes) - sum(before))
            bad, ties = len(problems) - before[0], len(notes) - before[1]
            verdict = "NO" if bad else ("yes, but for near-ties" if ties else "yes")
            rows.append((f"fp32 greedy, batch {b}", f"spec(4) == plain: {verdict}, accepted "
                         f"length {acc:.2f} of 5"))
        if notes:
            rows.append(("near-tie divergences", "; ".join(notes[:3])))
        # speed, bf16 greedy
        a16, d16 = self.model(torch.bfloat16), self.model(torch.bfloat16, "draft")
        for b in s.spec_batches:
            if b != s.spec_batches[0] and not self.enough(20):
                rows.append((f"bf16 greedy, batch {b}", "not run: the time budget is short"))
                continue
            prompts = self.prompts(b)
            out = {}
            for name, draft, spec in (("plain", None, SpecConfig(0)), ("spec4", d16, SpecConfig(4))):
                gen = Generator(a16, draft, pad_id=self.pad_id)
                gen.generate(prompts, greedy, spec)  # warm-up at full length (graphs kept)
                self.sync()
                t0 = time.perf_counter()
                r = gen.generate(prompts, greedy, spec)
                self.sync()
                out[name] = (r, r.stats.new_tokens / (time.perf_counter() - t0))
                _release(gen)
            same = all(torch.equal(out["plain"][0].response_ids[i], out["spec4"][0].response_ids[i])
                       for i in range(b))
            acc = out["spec4"][0].stats.mean_accepted_length
            speedup = out["spec4"][1] / out["plain"][1]
            self.report.measure("speculative_speed", batch=b, dtype="bf16", new_tokens=s.spec_new,
                                plain_tok_s=out["plain"][1], spec_tok_s=out["spec4"][1],
                                speedup=speedup, mean_accepted_length=acc, tokens_equal=same,
                                spec_stats=out["spec4"][0].stats.to_dict())
            rows.append((f"bf16 greedy, batch {b}", f"spec(4) {out['spec4'][1]:.0f} tok/s vs plain "
                         f"{out['plain'][1]:.0f}: x{speedup:.2f}, accepted length {acc:.2f}, "
                         f"tokens {'equal' if same else 'differ (bf16 rounding)'}"))
        # auto
        b = s.spec_batches[-1] if self.enough(20) else s.spec_batches[0]
        prompts = self.prompts(b)
        gen = Generator(a16, d16, pad_id=self.pad_id)
        auto = SpecConfig("auto", max_draft_tokens=4)
        t0 = time.perf_counter()
        gen.generate(prompts, greedy, auto)  # profiles the step costs, captures graphs
        self.sync()
        t_prof = time.perf_counter() - t0
        t0 = time.perf_counter()
        r = gen.generate(prompts, greedy, auto)
        self.sync()
        tok_s = r.stats.new_tokens / (time.perf_counter() - t0)
        _release(gen)
        self.report.measure("speculative_auto", batch=b, new_tokens=s.spec_new, tok_s=tok_s,
                            profile_and_warm_s=t_prof, stats=r.stats.to_dict())
        rows.append((f"auto (max 4), bf16, batch {b}", f"rounds by draft length "
                     f"{r.stats.rounds_by_draft_len}, {tok_s:.0f} tok/s, accepted length "
                     f"{r.stats.mean_accepted_length:.2f} (first call, with profiling: {t_prof:.1f} s)"))
        if problems:
            raise CheckFailed(f"greedy speculative != greedy plain beyond a near-tie: {problems[0]}")
        return (f"self-draft (actor checkpoint as draft), {s.spec_new} new tokens; equality in fp32"
                + (f", {len(notes)} near-tie divergences" if notes else ""))

    def _gap(self, model, ids: list[int], token: int | None) -> float:
        """How far ``token`` is below the argmax of the model's next-token logits after ``ids``
        (a full forward, fp32); inf when there is no token to compare."""
        from megatron_rlhf.models.forward import lm_logits

        if token is None:
            return math.inf
        with torch.no_grad():
            logits = lm_logits(model, torch.tensor([ids], device=self.dev))[0, -1].float()
        return float(logits.max() - logits[token])

    # ------------------------------------------------------------------ 6. padded batch
    def st_padded(self, rows) -> str:
        from megatron_rlhf.models.forward import lm_logits

        lens = (5, 9, 13)
        g = torch.Generator().manual_seed(self.args.seed)
        vocab = len(self.load_tokenizer())
        seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
        t = max(lens)
        ids = torch.full((len(seqs), t), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), t, dtype=torch.long)
        for i, sq in enumerate(seqs):
            ids[i, t - len(sq):] = torch.tensor(sq)
            mask[i, t - len(sq):] = 1
        ids, mask = ids.to(self.dev), mask.to(self.dev)
        failures = []
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
            model = self.model(dtype)
            with torch.no_grad():
                alone = [lm_logits(model, torch.tensor([sq], device=self.dev))[0].float() for sq in seqs]
                padded = lm_logits(model, ids, mask).float()
                unmasked = lm_logits(model, ids, None).float()
            err, ctl = 0.0, 0.0
            abs_err = 0.0
            for i, sq in enumerate(seqs):
                a, p, u = alone[i], padded[i, t - len(sq):], unmasked[i, t - len(sq):]
                scale = float(a.abs().max())
                abs_err = max(abs_err, float((p - a).abs().max()))
                err = max(err, float((p - a).abs().max()) / scale)
                if len(sq) < t:  # the longest row has no padding: the mask changes nothing there
                    ctl = max(ctl, float((u - a).abs().max()) / scale)
            name = str(dtype).removeprefix("torch.")
            self.report.measure("padded", dtype=name, lengths=list(lens), max_abs_err=abs_err,
                                max_rel_err=err, tolerance=tol, no_mask_rel_err=ctl)
            rows.append((name, f"max abs err {abs_err:.2e}, rel {err:.2e} (tol {tol:g}); without the "
                               f"mask rel {ctl:.2e} ({'differs' if ctl > tol else 'DOES NOT differ'})"))
            if err > tol:
                failures.append(f"{name}: padded != alone (rel {err:.2e} > {tol:g})")
            if ctl <= tol:
                failures.append(f"{name}: the control without the mask does not differ ({ctl:.2e})")
        if failures:
            raise CheckFailed("; ".join(failures))
        return f"lengths {lens} left-padded to {t}, lm_logits, fp32 and bf16 on {self.dev.type}"

    # ------------------------------------------------------------------ 5. PPO / GRPO
    def st_train(self, rows, name: str) -> str:
        s = self.shape
        ckpt = self.need_ckpt()
        self.free()  # the in-process models leave the device to the training run
        flags = dict(s.ppo if name == "ppo" else s.grpo)
        log_dir = self.work / f"log_{name}"
        shutil.rmtree(log_dir, ignore_errors=True)
        iters = flags["train_iters"]
        args = ["--actor-load", str(ckpt), "--reward-fn", "concise", "--log-dir", str(log_dir),
                "--lr", "1e-6", "--critic-lr", "5e-6", "--temperature", "1.0",
                "--seed", str(self.args.seed), "--bf16"]
        if name == "grpo":
            args += ["--advantage-estimator", "grpo"]
        if not self.graphs:
            args += ["--no-cuda-graphs"]
        if not getattr(self.load_tokenizer(), "chat_template", None):
            # a tokenizer without a chat template (the char tokenizer): short plain prompts
            prompts = self.work / "prompts.jsonl"
            texts = {tuple(p) for p in self.prompts(64)}
            tok = self.load_tokenizer()
            prompts.write_text("".join(json.dumps({"prompt": tok.decode(list(t), skip_special_tokens=True)})
                                       + "\n" for t in sorted(texts)))
            args += ["--no-chat", "--prompts", str(prompts)]
        for k, v in flags.items():
            args += ["--" + k.replace("_", "-"), str(v)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               "-m", "megatron_rlhf.train", *args]
        t0 = time.perf_counter()
        code = self.run_cmd(name, cmd, timeout=min(s.train_timeout_s, self.remaining()))
        wall = time.perf_counter() - t0
        metrics_file = log_dir / "metrics.jsonl"
        if metrics_file.exists():
            shutil.copy(metrics_file, self.out / f"{name}_metrics.jsonl")
        if code != 0:
            raise CheckFailed(f"megatron_rlhf.train exited {code} after {wall:.0f} s: "
                              + self.last_error(name))
        m = [json.loads(x) for x in metrics_file.read_text().splitlines() if x.strip()]
        if len(m) != iters:
            raise CheckFailed(f"{len(m)} iterations in metrics.jsonl, want {iters}")
        nan = sorted({k for row in m for k, v in row.items()
                      if isinstance(v, float) and not math.isfinite(v)})
        for row in m:
            self.report.measure(name, **row)
        for st in ("rollout", "experience", "train"):
            times = [row.get(f"time_{st}_s") for row in m]
            peaks = [row.get(f"peak_mem_{st}_gb") for row in m if f"peak_mem_{st}_gb" in row]
            rows.append((st, "time " + " / ".join(fmt(x) for x in times) + " s; peak mem "
                         + (f"{max(peaks):.1f} GB" if peaks else "n/a (no GPU)")))
        rows.append(("reward_mean by iteration", " / ".join(fmt(r.get("reward_mean")) for r in m)))
        rows.append(("kl, gen tok/s (last)", f"{fmt(m[-1].get('kl'))}, {fmt(m[-1].get('gen_tokens_per_s'))}"))
        if nan:
            raise CheckFailed(f"non-finite metrics: {nan}")
        est = "GAE with a critic" if name == "ppo" else "GRPO (group-normalised, no critic)"
        return (f"{iters} iterations, {est}, {flags['global_batch_size']} prompts x {flags['rollout_n']}, "
                f"{flags['max_new_tokens']} new tokens, bf16, cuda graphs {self.graph_state}; "
                f"wall {wall:.0f} s incl. startup")


def _watchdog(check: Check, seconds: float) -> None:
    """After ``seconds``: mark the running stage as hung, write the summary, dump every
    thread's stack and exit, so a hang still returns results before the run is killed."""
    def fire():
        row = check.current
        if row is not None:
            row.update(status="FAIL", details=f"HUNG: still running at the {seconds:.0f} s watchdog")
        check.report.save()
        print(check.report.table(), flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU is fine): test the script")
    p.add_argument("--out", default=os.environ.get("OUT") or "out/gpu_check",
                   help="summary.json, measurements.jsonl, logs (default: $OUT, else out/gpu_check)")
    p.add_argument("--work", default=None, help="checkpoints and run directories (default: a new temp dir)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: .whl/tokenizer)")
    p.add_argument("--stages", default=",".join(STAGES),
                   help=f"comma-separated subset of {','.join(STAGES)} (convert is needed by the rest)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the whole check, the install included (default: 420 on the 1b "
                        "shape, none with --smoke): decode stages that no longer fit are skipped; "
                        "a watchdog ends a hung run 30 s after it")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="every generating stage (and the training runs) decodes eagerly")
    p.add_argument("--install-s", type=float, default=None,
                   help="seconds gpu_check.sh spent installing (the install row; counted in the budget)")
    p.add_argument("--installed", default="", help="what gpu_check.sh installed (the install row)")
    p.add_argument("--install-error", default="",
                   help="why gpu_check.sh's install failed (the install row FAILs; the stages run "
                        "when megatron.core imports)")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(args.stages) - set(STAGES)
    if unknown:
        p.error(f"unknown stages {sorted(unknown)}; choose from {','.join(STAGES)}")
    if args.budget_s is None and not args.smoke:
        args.budget_s = 420.0
    return args


def prepare(args: argparse.Namespace) -> Check:
    """The check with its report (the header written, old outputs removed), the install row
    recorded; no stage run yet."""
    check = Check(args)
    s = check.shape
    header = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "mode": "smoke" if args.smoke else "1b",
        "device": torch.cuda.get_device_name(0) if check.cuda else "cpu",
        "python": sys.version.split()[0], **_versions(),
        "decode_attention": _decode_attention(s, check.dev),
        "cuda_graphs": check.graph_state,
        "model": f"Llama {s.layers}x{s.hidden} h{s.heads}/{s.kv_heads} ffn {s.ffn}",
        "budget": f"{args.budget_s:g} s" if args.budget_s else "none",
        "install_s": args.install_s,
        "work": str(check.work), "argv": sys.argv[1:],
    }
    if check.out.exists():
        for name in OUT_FILES:
            (check.out / name).unlink(missing_ok=True)
    check.report = Report(check.out, header)
    check.record_install()
    return check


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    if torch.cuda.is_available():  # fp32 comparisons must not run in TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")

    check = prepare(args)
    h = check.report.header
    if args.budget_s:
        _watchdog(check, check.remaining() + 30)
    print(f"GPU check: {h['device']}, torch {h['torch']} (CUDA {h['cuda']}, cuDNN {h['cudnn']}), "
          f"megatron-core {h['megatron_core']}, transformers {h['transformers']}, decode attention "
          f"{h['decode_attention']}, cuda graphs {h['cuda_graphs']}, budget {h['budget']}; "
          f"out {check.out}, work {check.work}", file=sys.stderr, flush=True)
    check.run()
    check.free()
    check.report.save()
    print(check.report.table(), flush=True)
    if not args.work:
        shutil.rmtree(check.work, ignore_errors=True)
    if check.pg is not None:
        from megatron_rlhf import platform

        platform.shutdown()
    return 0 if check.report.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
