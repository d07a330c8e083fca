"""The GPU check's MoE stage: a random-weight mixture of experts with Qwen3-30B-A3B's layer shape
(128 experts of 768, top-8, q/k norms; fewer layers: ``MOE_LAYERS``) decoded from CUDA graphs,
whose static step runs every expert over every token, against the dynamic step, which gathers
each expert's tokens. fp32 greedy: the samples and the recorded routes of both (a gross error fails the stage:
near-ties may differ); bf16 sampling: tokens per second of both per batch. A mixin of ``gpu_check.stages.Check``.

Invariant: a capture that fails fails the stage (the generator would decode eagerly)."""

from __future__ import annotations

import time

import torch

from gpu_check.decode import _capture_failures
from gpu_check.models import _release
from gpu_check.report import CheckFailed

MOE_LAYERS = {"1b": 4, "smoke": 2}  # layers of the stage's model per shape
MOE_BATCHES = {"1b": (1, 16, 64), "smoke": (1, 2)}  # the timed batches
MIN_EQUAL = 0.5  # the least share of fp32 greedy samples equal with and without graphs


class MoEStage:
    """The ``moe`` stage of ``gpu_check.stages.Check``."""

    def moe_model(self, dtype: torch.dtype):
        """The stage's model in ``dtype`` (random weights, seeded; cached with the others)."""
        key = (dtype, "moe")
        if key not in self.models:
            from megatron_rlhf.config import preset
            from megatron_rlhf.models.builder import build_model

            name = "tiny-qwen3-moe" if self.smoke else "qwen3-30b-a3b"
            cfg = preset(name, num_layers=MOE_LAYERS["smoke" if self.smoke else "1b"],
                         vocab_size=len(self.load_tokenizer()), max_position_embeddings=4096,
                         eos_token_id=None)
            m = build_model(cfg, "actor", self.init_dist(), dtype=dtype, seed=self.args.seed)
            self.models[key] = m.to(self.dev).eval()
        return self.models[key]

    def st_moe(self, rows) -> str:
        from megatron_rlhf.config import GenerationConfig, SpecConfig
        from megatron_rlhf.generation import graphs
        from megatron_rlhf.generation.engine import Generator

        s = self.shape
        graphed = "eager" if not self.cuda or not self.graphs else "auto"
        # 1. fp32 greedy: the same samples and routes from the graphs as from the dynamic step
        model = self.moe_model(torch.float32)
        if not graphs.graphable(model):
            raise CheckFailed("the MoE model's decode step is not graphable (incremental.plain_layers)")
        prompts = self.prompts(max(s.spec_batches), split="heldout")
        greedy = GenerationConfig(max_new_tokens=s.spec_new, temperature=0.0, stop_on_eos=False,
                                  cuda_graphs=self.graphs)
        ref = Generator(model, pad_id=self.pad_id, graphs="off").generate(prompts, greedy, SpecConfig(0))
        gen = Generator(model, pad_id=self.pad_id, graphs=graphed)
        r = gen.generate(prompts, greedy, SpecConfig(0))
        failed = _capture_failures(gen)
        _release(gen)
        if failed:
            rows.append(("CUDA graph capture FAILED", failed[:300]))
            raise CheckFailed(f"MoE step capture failed: {failed}"[:300])
        if r.routes is None or len(r.routes) != len(prompts):
            raise CheckFailed("the graphed MoE rollout kept no routes")
        equal, routes_equal, first = 0, 0, []
        for i, p in enumerate(prompts):
            x, y = ref.response_ids[i].tolist(), r.response_ids[i].tolist()
            j = next((k for k in range(len(x)) if x[k] != y[k]), None)
            first.append(j)
            equal += j is None
            fed = len(p) + (len(x) if j is None else j) - 1  # routes of the tokens both fed
            routes_equal += torch.equal(r.routes[i][:fed], ref.routes[i][:fed])
        self.report.measure("moe", part="fp32 greedy", samples=len(prompts), equal=equal,
                            routes_equal=routes_equal, first_divergence=first, decode=r.stats.decode)
        rows.append(("fp32 greedy, graphs vs dynamic",
                     f"{equal}/{len(prompts)} samples equal, routes equal in {routes_equal} over the "
                     f"tokens both fed ({r.stats.decode})"))
        if equal < MIN_EQUAL * len(prompts):  # (fp32 sums in other orders: near-ties may differ)
            raise CheckFailed(f"graphed MoE decode differs from the dynamic one: {equal}/{len(prompts)} "
                              "samples equal")
        self.models.pop((torch.float32, "moe"), None)
        # 2. bf16 sampling speed: the static step (every expert) against the dynamic one
        model = self.moe_model(torch.bfloat16)
        sampled = GenerationConfig(max_new_tokens=s.bench_new, temperature=1.0, top_k=0, top_p=1.0,
                                   stop_on_eos=False, cuda_graphs=self.graphs)
        for b in MOE_BATCHES["smoke" if self.smoke else "1b"]:
            if not self.enough(30):
                rows.append((f"batch {b}", "not run: the time budget is short"))
                continue
            speed = {}
            for way in (graphed, "off"):
                gen = Generator(model, pad_id=self.pad_id, graphs=way)
                batch = self.prompts(b)
                gen.generate(batch, sampled, SpecConfig(0), seed=0)  # warm-up (and capture)
                self.sync()
                t0 = time.perf_counter()
                out = gen.generate(batch, sampled, SpecConfig(0), seed=1)
                self.sync()
                speed[way] = out.stats.new_tokens / (time.perf_counter() - t0)
                _release(gen)
            ratio = speed[graphed] / speed["off"]
            self.report.measure("moe", part="bf16 speed", batch=b, graphed_tok_s=speed[graphed],
                                dynamic_tok_s=speed["off"], ratio=ratio)
            rows.append((f"batch {b}", f"graphs {speed[graphed]:.0f} tok/s, dynamic {speed['off']:.0f} "
                                       f"tok/s: x{ratio:.2f}"))
        self.models.pop((torch.bfloat16, "moe"), None)
        cfg = model.mrlhf_config
        return (f"{cfg.num_layers} layers of {cfg.num_experts} experts x {cfg.moe_ffn_hidden_size}, top-"
                f"{cfg.moe_router_topk}, random weights; graphs: {graphed}")
