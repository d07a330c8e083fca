"""The GPU check's decode stages: greedy equality with HF, the bf16 graphed decode against the
whole-sequence forward, the decode benches, the verification cost, speculative equality and
speed, padded batches, history drafts. A mixin of ``gpu_check.stages.Check``, whose state
(model builders, prompts, budget, report rows) the stages use."""

from __future__ import annotations

import math
import time

import torch

from gpu_check.models import _capture_note, _eager_time_step, _hf_sample_time, _release
from gpu_check.report import CheckFailed
from gpu_check.shapes import GOALS, NEAR_TIE

DECODE_TOLERANCE = 3e-2
"""bf16 decode logits vs the whole-sequence forward, relative to the largest logit (as in
tests/unit/test_decode_attention.py)."""


def _capture_failures(gen) -> str:
    """Why a generator's CUDA graph captures failed (it then decodes eagerly), or ''."""
    steps = getattr(gen, "_steps", {}) or {}
    return "; ".join(f"{name}: {g.failed}" for name, g in steps.items() if getattr(g, "failed", None))


class DecodeStages:
    """The decode stages of ``gpu_check.stages.Check`` (run after convert, PPO and GRPO)."""

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
        gen.generate(prompts, greedy, auto)  # learns the round costs, captures graphs
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
                     f"{r.stats.mean_accepted_length:.2f} (first call, graphs captured: {t_prof:.1f} s)"))
        if problems:
            raise CheckFailed(f"greedy speculative != greedy plain beyond a near-tie: {problems[0]}")
        return (f"self-draft (actor checkpoint as draft), {s.spec_new} new tokens; equality in fp32"
                + (f", {len(notes)} near-tie divergences" if notes else ""))

    # ------------------------------------------------------------------ 5. history drafts
    def st_history(self, rows) -> str:
        """History drafts (issue 27) through the graphed verification round (issue 28): bf16,
        sampled (T=1), the same prompts and seed twice with one generator. The second call
        repeats the first's samples (exact verification emits plain sampling's tokens), so
        its drafts are whole answers: the best case of drafting from a rollout's history,
        which measures what a graphed verification round costs against plain steps. Tokens
        are compared with plain sampling (bf16: a verification's wider GEMMs may flip a
        near-tie)."""
        from megatron_rlhf.config import GenerationConfig, SpecConfig
        from megatron_rlhf.generation.engine import Generator, history_drafter

        s = self.shape
        cfg = GenerationConfig(max_new_tokens=s.spec_new, temperature=1.0, stop_on_eos=False,
                               cuda_graphs=self.graphs)
        a16 = self.model(torch.bfloat16)
        failures = []
        for b in s.spec_batches:
            if b != s.spec_batches[0] and not self.enough(20):
                rows.append((f"history, batch {b}", "not run: the time budget is short"))
                continue
            prompts = self.prompts(b)
            plain = Generator(a16, pad_id=self.pad_id)
            plain.generate(prompts, cfg, SpecConfig(0), seed=1)  # warm-up (graphs kept)
            ref, t_plain = self._timed(lambda: plain.generate(prompts, cfg, SpecConfig(0), seed=1))
            _release(plain)
            for name, spec in (("n=4", SpecConfig(4, draft_source="history")),
                               ("auto", SpecConfig("auto", max_draft_tokens=4, draft_source="history"))):
                gen = Generator(a16, pad_id=self.pad_id, history=history_drafter(spec))
                first, t_first = self._timed(lambda: gen.generate(prompts, cfg, spec, seed=1))
                again, t_again = self._timed(lambda: gen.generate(prompts, cfg, spec, seed=1))
                failures += [f"{name} batch {b}: {why}" for why in [_capture_failures(gen)] if why]
                _release(gen)
                same = [sum(torch.equal(r.response_ids[i], ref.response_ids[i]) for i in range(b))
                        for r in (first, again)]
                st = again.stats
                self.report.measure("history_speed", batch=b, dtype="bf16", variant=name,
                                    new_tokens=s.spec_new, plain_s=t_plain, first_s=t_first,
                                    again_s=t_again, speedup=t_plain / t_again,
                                    samples_equal_first=same[0], samples_equal_again=same[1],
                                    stats=st.to_dict())
                accepted = 1 + st.history_accepted / max(st.verifications, 1)
                rows.append((f"history {name}, bf16 T=1, batch {b}",
                             f"repeat x{t_plain / t_again:.2f} vs plain ({accepted:.2f} tokens per "
                             f"verification, rounds by draft length {st.rounds_by_draft_len}); first call "
                             f"x{t_plain / t_first:.2f} (graphs captured); samples equal to plain: "
                             f"{same[0]}/{b}, {same[1]}/{b}"))
        if failures:
            raise CheckFailed("graph capture failed: " + "; ".join(failures))
        return f"{s.spec_new} new tokens; the repeat's drafts are the first call's answers"

    def _timed(self, fn):
        """``fn()`` and its seconds, the device synchronised around it."""
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0

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
