"""The GPU check's bitwise on-policy stage: the generator's log-probs of the tokens it sampled
against the trainer's forward on the same tokens (``rlhf.experience.response_logprobs``, the
recomputed log pi_old), with megatron-core's ``batch_invariant_mode`` off, then on: the fraction
of response tokens whose log-probs are bit-equal, the decode step and forward times. The
fractions are measurements, not goals. A mixin of ``gpu_check.stages.Check``.

Invariants: the mode (Triton kernels for aten mm/addmm/_log_softmax/mean.dim, TE's GEMM and
RMSNorm) patches kernels process-wide, so the stage runs in a process group of its own and turns
the mode off again on its way out. Where it cannot run (Triton does not import, no CUDA device)
the stage measures the mode off and its row says why the mode was not measured. The model
config's ``batch_invariant_mode`` is not set: it asks for megatron's flash attention backend and
only picks flash attention's splits, which neither our decode nor our forward path runs."""

from __future__ import annotations

import importlib
import time

import torch

from gpu_check.decode import _capture_failures
from gpu_check.models import _release
from gpu_check.report import CheckFailed

BIK_MODULE = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
PROBE_ROWS = 64  # the batch whose first row the matmul probe also computes alone


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bit patterns as integers of its element size."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.contiguous().view(ints[x.element_size()])


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where ``a`` and ``b`` (one floating dtype and shape) hold the same bits (bool, their
    shape): ``-0.0`` differs from ``0.0``, a NaN equals the same NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"bit_equal compares one dtype and shape: {a.dtype} {tuple(a.shape)} "
                         f"against {b.dtype} {tuple(b.shape)}")
    return _bits(a) == _bits(b)


def bit_equal_fraction(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """The fraction of the positions ``mask`` selects at which ``a`` and ``b`` are bit-equal."""
    keep = mask.bool()
    if not keep.any():
        raise ValueError("bit_equal_fraction: the mask selects no position")
    return int(bit_equal(a, b)[keep].sum()) / int(keep.sum())


def batch_invariant_unavailable(cuda: bool) -> str:
    """Why ``batch_invariant_mode`` cannot run here, or ''. Its module imports triton; its
    kernels are Triton GPU kernels (enabled without a GPU it would send CPU matmuls to them)."""
    try:
        importlib.import_module(BIK_MODULE)
    except Exception as e:  # noqa: BLE001 - any import failure is the row's reason
        if isinstance(e, ImportError) and (e.name or "").split(".")[0] == "triton":
            return f"triton does not import ({e})"[:200]
        return f"{BIK_MODULE} does not import ({type(e).__name__}: {e})"[:300]
    if not cuda:
        return "no CUDA device (its kernels are Triton GPU kernels)"
    return ""


class BitwiseStage:
    """The bitwise on-policy stage of ``gpu_check.stages.Check``."""

    def st_bitwise(self, rows) -> str:
        from megatron_rlhf.config import GenerationConfig

        s = self.shape
        cfg = GenerationConfig(max_new_tokens=s.bitwise_new, temperature=1.0, top_k=0, top_p=1.0,
                               stop_on_eos=False, cuda_graphs=self.graphs)
        actor = self.model(torch.bfloat16)
        prompts = self.prompts(s.bitwise_batch)
        why = batch_invariant_unavailable(self.cuda)
        results = {"off": self._on_policy(actor, prompts, cfg)}
        if not why:
            bik = importlib.import_module(BIK_MODULE)
            with bik.set_batch_invariant_mode(True):
                results["on"] = self._on_policy(actor, prompts, cfg)
            if bik.is_batch_invariant_mode_enabled():
                raise CheckFailed("batch_invariant_mode is still on after the stage turned it off")
        for mode, r in results.items():
            failed = f"; graph capture FAILED: {r['capture_failed'][:200]}" if r["capture_failed"] else ""
            self.report.measure("bitwise", mode=mode, batch=len(prompts), new_tokens=s.bitwise_new,
                                dtype="bf16", **r)
            rows.append((f"batch_invariant_mode {mode}",
                         f"{r['equal']}/{r['tokens']} response log-probs bit-equal to the trainer's "
                         f"({r['fraction']:.1%}, max |diff| {r['max_abs_diff']:.2e}); the generator's "
                         f"formula on the trainer's logits {r['formula_fraction']:.1%}; mm row alone "
                         f"== in a batch of {PROBE_ROWS}: {'yes' if r['mm_rows_invariant'] else 'no'}; "
                         f"decode {r['step_ms']:.2f} ms/step, trainer forward {r['forward_ms']:.1f} ms"
                         + failed))
        bad = [m for m, r in results.items() if not r["finite"]]
        if bad:
            raise CheckFailed(f"non-finite log-probs with batch_invariant_mode {', '.join(bad)}")
        if "on" in results and not results["on"]["mm_rows_invariant"]:
            raise CheckFailed("batch_invariant_mode on: a matmul row alone != the same row in a batch "
                              f"of {PROBE_ROWS} (the mode did not take effect)")
        off = results["off"]
        what = f"bf16 T=1 sampling, {len(prompts)} prompts x {s.bitwise_new} tokens"
        if why:
            rows.append(("batch_invariant_mode on", f"NOT MEASURED: {why}"))
            return (f"batch_invariant_mode NOT MEASURED: {why}; with it off {off['fraction']:.1%} of "
                    f"the generator's log-probs bit-equal to the trainer forward's ({what})")
        on = results["on"]
        return (f"generator log-probs bit-equal to the trainer forward's: batch_invariant_mode off "
                f"{off['fraction']:.1%}, on {on['fraction']:.1%}; with it on, decode step "
                f"x{on['step_ms'] / off['step_ms']:.2f}, forward x{on['forward_ms'] / off['forward_ms']:.2f} "
                f"({what})")

    def _on_policy(self, actor, prompts: list[list[int]], cfg) -> dict:
        """One rollout of ``prompts`` and the trainer's forward on its tokens, in the current
        kernel mode: the bit-equal fraction, what bounds it and the times."""
        from megatron_rlhf.config import SpecConfig
        from megatron_rlhf.generation.engine import Generator
        from megatron_rlhf.rlhf.batch import Experience, pack

        gen = Generator(actor, pad_id=self.pad_id)
        gen.generate(prompts, cfg, SpecConfig(0), seed=0)  # warm-up: graphs captured, kernels compiled
        r, _ = self._timed(lambda: gen.generate(prompts, cfg, SpecConfig(0), seed=1))
        failed = _capture_failures(gen)
        _release(gen)
        st = r.stats
        ids, att, mask = pack(prompts, r.responses(), self.pad_id, self.dev)
        zeros = torch.zeros_like(mask)
        exp = Experience(input_ids=ids, attention_mask=att, response_mask=mask, old_logprobs=zeros,
                         ref_logprobs=zeros, scores=torch.zeros(len(prompts), device=self.dev), kl=zeros,
                         advantages=zeros, policy=cfg)
        trainer, forward_s = self._trainer_logprobs(actor, exp)
        ours = r.response_logprobs.to(trainer.device)
        if ours.shape != trainer.shape:
            raise CheckFailed(f"generator log-probs {tuple(ours.shape)} != the trainer's "
                              f"{tuple(trainer.shape)}")
        keep = mask.bool()
        return {"equal": int(bit_equal(ours, trainer)[keep].sum()), "tokens": int(keep.sum()),
                "fraction": bit_equal_fraction(ours, trainer, mask),
                "max_abs_diff": float((ours - trainer)[keep].abs().max()),
                "formula_fraction": self._formula_fraction(actor, exp),
                "mm_rows_invariant": self._mm_rows_invariant(actor),
                "finite": bool(torch.isfinite(ours[keep]).all() and torch.isfinite(trainer[keep]).all()),
                "step_ms": (st.elapsed_s - st.prefill_s) / max(st.actor_steps, 1) * 1e3,
                "prefill_ms": st.prefill_s * 1e3, "forward_ms": forward_s * 1e3,
                "capture_failed": failed or None}

    def _trainer_logprobs(self, actor, exp):
        """The trainer's log-probs of ``exp``'s responses (one micro-batch) and the seconds of
        the second of two calls (the first compiles)."""
        from megatron_rlhf.rlhf.experience import response_logprobs

        response_logprobs(actor, exp, exp.batch_size)
        self.sync()
        t0 = time.perf_counter()
        out = response_logprobs(actor, exp, exp.batch_size)
        self.sync()
        return out, time.perf_counter() - t0

    def _formula_fraction(self, actor, exp) -> float:
        """The fraction of response tokens at which the generator's log-prob formula
        (``sampling.logprob_pair``) on the trainer's logits is bit-equal to the trainer's
        (``policy.policy_logprobs``): the most the first fraction reaches with bit-equal logits."""
        from megatron_rlhf.generation.sampling import logprob_pair, probs_for_sampling
        from megatron_rlhf.models.forward import logits_of
        from megatron_rlhf.rlhf.batch import response_slice
        from megatron_rlhf.rlhf.experience import per_row
        from megatron_rlhf.rlhf.policy import policy_logprobs

        def fn(output, mb):
            logits = response_slice(logits_of(actor, output), mb)
            trainer = policy_logprobs(logits, mb.response_ids, mb.policy)
            ours, _ = logprob_pair(logits, probs_for_sampling(logits, mb.policy), mb.response_ids, mb.policy)
            return bit_equal(ours.float(), trainer).float() * mb.response_mask

        equal = per_row(actor, exp, exp.batch_size, fn)
        return float(equal.sum() / exp.response_mask.sum())

    def _mm_rows_invariant(self, actor) -> bool:
        """Whether the output layer's bf16 matmul gives a row alone the bits it gets in a batch
        of :data:`PROBE_ROWS` (what batch_invariant_mode promises; cuBLAS need not)."""
        w = actor.embedding.word_embeddings.weight  # [V, H] (the output layer's, tied)
        g = torch.Generator().manual_seed(self.args.seed)
        x = torch.randn(PROBE_ROWS, w.shape[1], generator=g).to(w.device, w.dtype)
        with torch.no_grad():
            return bool(bit_equal(torch.nn.functional.linear(x[:1], w),
                                  torch.nn.functional.linear(x, w)[:1]).all())
