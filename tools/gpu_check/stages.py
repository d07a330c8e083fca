"""The GPU check's stage scheduler and its setup and training stages (the decode stages:
``gpu_check.decode``). Each stage is timed; an error fails its stage only. Training runs before
the decode stages, so a short budget skips decode stages (SKIP, not a failure), never training
(a setup or training stage that cannot start FAILs). Each process group of ``PLAN`` runs in a
process of its own (``gpu_check.processes``); a stage past its deadline reads TIMEOUT."""

from __future__ import annotations

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
import time
import traceback
from pathlib import Path

import torch

from gpu_check.bitwise import BitwiseStage
from gpu_check.budget import minimum, stage_end
from gpu_check.decode import DecodeStages
from gpu_check.moe import MoEStage
from gpu_check.models import _fallback_tokenizer, _hf_no_eos, _llama_config, _tokenizer_from_dir
from gpu_check.report import CheckFailed, Report, StageTimeout, fmt
from gpu_check.shapes import SHAPES

ROOT = Path(__file__).resolve().parents[2]

PLAN = (
    # (stage, kind, process group), in the order they run; minimums: gpu_check.budget
    ("convert", "setup", "prepare"),  # a random HF Llama (bf16 values) converted by tools/convert_checkpoint.py
    ("ppo", "train", "prepare"),  # torchrun -m megatron_rlhf.train: stage times, peak memory
    ("grpo", "train", "prepare"),
    ("greedy", "decode", "decode"),  # our generator == transformers greedy, fp32 (a divergence only at a near-tie)
    ("decode_bf16", "decode", "decode"),  # graphed and dynamic decode logits == the whole-sequence forward
    ("bench", "decode", "decode"),  # bf16 sampling, EOS ignored: ours against HF generate per batch size
    ("verify", "decode", "decode"),  # a cached forward of 5 tokens against 1 per sample
    ("speculative", "decode", "decode"),  # the actor as its own draft: equality, acceptance, speed, auto's choice
    ("padded", "decode", "decode"),  # a left-padded batch == each sequence alone; without the mask they differ
    ("history", "decode", "decode"),  # history drafts through the graphed verification round
    ("moe", "decode", "decode"),  # a Qwen3-MoE layer shape: graphed (every expert) vs dynamic decode
    # generator vs trainer log-probs bit-equal, batch_invariant_mode off and on (where Triton
    # imports); a group of its own: the mode patches aten kernels process-wide
    ("bitwise", "decode", "bitwise"),
)
STAGES = tuple(name for name, _, _ in PLAN)
KIND = {name: kind for name, kind, _ in PLAN}
STICKY = re.compile(r"CUDA error|device-side assert|illegal memory access|CUBLAS_STATUS|CUDNN_STATUS"
                    r"|unspecified launch failure")
"""Errors after which a process's CUDA context is unusable: its group goes on in a fresh process."""

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


class Check(DecodeStages, BitwiseStage, MoEStage):
    """The check's state, its stage scheduler and the setup and training stages (the decode
    stages: :class:`gpu_check.decode.DecodeStages`, :class:`gpu_check.bitwise.BitwiseStage`,
    :class:`gpu_check.moe.MoEStage`)."""

    def __init__(self, args, blocked: str | None = None):
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
        self.graphs = bool(args.cuda_graphs)  # generating stages replay CUDA graphs (on CUDA)
        # no stage can run without megatron.core (a stage process is told by its parent)
        self.blocked = _import_error("megatron.core") if blocked is None else blocked
        # the budget's end (the install, before this process, is not counted)
        self.deadline = time.perf_counter() + args.budget_s if args.budget_s else None
        self.stage_deadline = None  # the running stage's
        self.tokenizer = None
        self.tokenizer_source = None
        self.pg = None
        self.models: dict = {}
        self.hf: dict = {}
        self.report: Report | None = None
        self.current = None
        self.relay = None  # in a stage process: the pipe to the parent (gpu_check.processes)
        self.poisoned = False  # a sticky CUDA error: this process runs no further stage
        self.proc = None  # the running subprocess of run_cmd
        self.child = None  # in the parent: the running stage process

    # ------------------------------------------------------------------ helpers
    def remaining(self) -> float:
        """Seconds to the budget's end, or to the running stage's deadline when sooner."""
        ends = [e for e in (self.deadline, self.stage_deadline) if e is not None]
        return min(ends) - time.perf_counter() if ends else math.inf

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
        its exit code (raises StageTimeout on timeout, after killing the group)."""
        logs = self.out / "logs.txt"
        with logs.open("a") as f:
            f.write(f"\n===== {name} command: {' '.join(cmd)}\n")
            f.flush()
            p = subprocess.Popen(cmd, cwd=ROOT, env=self.env(), stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            self.proc = p  # ended with this process (gpu_check.processes)
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
                self.proc = None
            f.write(f"===== {name} exit status: {code}\n")
        if code is None:
            raise StageTimeout(f"timed out after {timeout:.0f} s (see logs.txt)")
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
            from megatron_rlhf import runtime
            from megatron_rlhf.parallel.groups import build_process_groups
            from megatron_rlhf.parallel.layout import Layout

            runtime.quiet_third_party_warnings()
            runtime.init_distributed(seed=self.args.seed)
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
                "speculative": self.st_speculative, "padded": self.st_padded,
                "history": self.st_history, "moe": self.st_moe, "bitwise": self.st_bitwise}

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
        """Every stage of :data:`PLAN` in order, in this process (``functions``: name ->
        function, default :meth:`functions`); the check itself runs them in processes of
        their own (:func:`gpu_check.processes.run_groups`)."""
        functions = functions or self.functions()
        for name, kind, _ in PLAN:
            self.stage(name, functions[name], kind)

    def not_run(self, name: str) -> str:
        """Why stage ``name`` runs in no case (not selected, megatron.core missing), or ''."""
        if name not in self.args.stages:
            return "not selected (--stages)"
        return "not run: megatron.core does not import" if self.blocked else ""

    def emit(self, kind: str, payload) -> None:
        """A stage row's news: to the parent from a stage process, else saved."""
        if self.relay is not None:
            self.relay.send((kind, payload))
        elif kind == "row":
            self.report.save()

    def stage(self, name: str, fn, kind: str = "decode") -> None:
        """Run stage ``name`` (``fn`` of its detail rows -> its summary) when its minimum is
        left; its row: PASS, FAIL, TIMEOUT or SKIP."""
        rep = self.report
        row = {"name": name, "status": "FAIL", "seconds": 0.0, "details": "", "rows": []}
        rep.stages.append(row)
        left, need = self.remaining(), minimum(name, getattr(self.args, "fake_stages", False))
        why = self.not_run(name)
        if why:
            row.update(status="SKIP", details=why)
        elif left < need:
            why = (f"{max(left, 0):.0f} s left of the {self.args.budget_s:g} s budget, "
                   f"the stage needs {need:g} s")
            if kind == "decode":  # decode stages yield the time to training: not a failure
                row.update(status="SKIP", skipped="time", details=f"skipped for time: {why}")
            else:
                row.update(details=f"not run: {why}")
        if row["details"]:
            self.emit("row", row)
            self.log(f"--- stage {name}: {row['status']}: {row['details']}")
            return
        t0 = time.perf_counter()
        self.stage_deadline = stage_end(t0, self.deadline, need, self.later(name))
        self.current = row
        self.emit("start", (row, None if self.stage_deadline is None
                            else time.time() + self.stage_deadline - t0))
        self.log(f"--- stage {name}")
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            details = fn(row["rows"])
            row.update(status="PASS", details=details)
        except StageTimeout as e:
            row.update(status="TIMEOUT", details=str(e))
        except CheckFailed as e:
            row.update(details=str(e))
        except Exception as e:  # noqa: BLE001 - every error fails its own stage only
            tb = traceback.format_exc()
            self.log(tb)
            row.update(details=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300],
                       error=tb)
            # the context is lost: no further stage in this process (the group goes on in another)
            self.poisoned = bool(STICKY.search(str(e)) or type(e).__name__ == "AcceleratorError")
            if self.poisoned:
                row["details"] += " (sticky: the stages after it run in a new process)"
        row["seconds"] = time.perf_counter() - t0
        self.stage_deadline = None
        if self.cuda and not self.poisoned:  # this process's peak (the training stages run in their own)
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
            if kind != "train":
                row["details"] += f"; peak {row['peak_mem_gb']:.1f} GiB"
        self.current = None
        self.emit("row", row)
        self.log(f"--- stage {name}: {row['status']} in {row['seconds']:.1f} s: {row['details']}")

    def later(self, name: str) -> list[float]:
        """The minimums of the selected stages after ``name`` of its kind (training and setup,
        or decode): what its deadline leaves them."""
        fake = getattr(self.args, "fake_stages", False)
        decode = KIND[name] == "decode"
        after = STAGES[STAGES.index(name) + 1:]
        return [minimum(n, fake) for n in after
                if n in self.args.stages and (KIND[n] == "decode") == decode]

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
