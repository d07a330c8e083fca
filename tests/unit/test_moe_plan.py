"""The memory estimator and the cost model price mixtures of experts: expert weights and
states per rank under expert parallelism, the active parameters' compute, the token exchange."""

import pytest

from megatron_rlhf.config import preset
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.plan import memory as mem
from megatron_rlhf.plan.cost import Estimator
from megatron_rlhf.plan.graph import Call
from megatron_rlhf.plan.hardware import HARDWARE


@pytest.mark.parametrize("name, total, active", [("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                                 ("mixtral-8x7b", 46.7e9, 12.9e9)])
def test_parameter_counts_match_the_published_ones(name, total, active):
    """Total and active parameters per token as their model cards give them (1%; the active
    count takes the input embedding's lookup as no work, the LM head as a matmul)."""
    cfg = preset(name)
    assert mem.count_parameters(cfg) == pytest.approx(total, rel=0.01)
    head = cfg.padded_vocab_size * cfg.hidden_size
    assert cfg.num_layers * mem.active_layer_params(cfg) + 2 * head == pytest.approx(active, rel=0.02)


def test_expert_parallelism_divides_the_experts_and_their_states():
    cfg = preset("mixtral-8x7b")
    params = mem.stage_params(cfg, "actor")
    experts = cfg.num_layers * 8 * 3 * 4096 * 14336
    assert params.experts == experts
    assert params.per_gpu(2, 4) == params.dense_per_gpu(2) + experts // 8
    o = mem.MemoryOptions(param_bytes=2)
    grads1, states1 = mem.trainee_state_bytes(cfg, "actor", Layout(tp=2, dp=8), o)
    grads4, states4 = mem.trainee_state_bytes(cfg, "actor", Layout(tp=2, dp=8, ep=4), o)
    dense = params.dense_per_gpu(2)
    assert grads1 == (dense + experts // 2) * 4 and grads4 == (dense + experts // 8) * 4
    # dense states over 8 DP ranks; the experts' over 8 at EP=1, over 8 / 4 = 2 at EP=4
    assert states1 == -(-dense * 12 // 8) - (-(experts // 2) * 12 // 8)
    assert states4 == -(-dense * 12 // 8) - (-(experts // 8) * 12 // 2)
    assert states4 == states1  # as many expert states per GPU either way: EP trades them for weights


def test_the_cost_model_prices_the_exchange_and_the_active_experts():
    cfg = preset("mixtral-8x7b")
    model = Estimator({"actor": cfg}, HARDWARE["h100"])
    assert model.expert_exchange(cfg, 4096, 1, 1) == 0.0
    assert model.expert_exchange(preset("llama2-7b"), 4096, 2, 4) == 0.0
    assert model.expert_exchange(cfg, 4096, 1, 4) > model.expert_exchange(cfg, 4096, 1, 2) > 0
    train = Call("actor_train", "actor", "train", 64, 512, 512)
    ep1 = model.call_time(train, Layout(tp=2, dp=8))
    ep4 = model.call_time(train, Layout(tp=2, dp=8, ep=4))
    assert ep4["compute"] > ep1["compute"]  # the exchange, with the same active compute
    # the same Adam states per GPU, a quarter of the expert gradients to zero and to reduce
    assert ep4["optimizer"] < ep1["optimizer"] and ep4["grad_sync"] < ep1["grad_sync"]
    dense_flops = 2 * mem.layer_params(cfg).sharded + 2 * 3 * 4096 * 14336 * 8
    assert mem.active_layer_params(cfg) < dense_flops / 2 / 3  # top-2 of 8 experts: a quarter
