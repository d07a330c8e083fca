"""Reward functions, registered by name (``base``, ``rules``, ``verifiers``), and the scorer
that runs one over a batch (``scorer``, on ``outcome``, ``timer`` and ``pool``)."""

from megatron_rlhf.rlhf.rewards.base import (REWARD_FUNCTIONS, RewardConfigError, RewardError,
                                             RewardFn, RewardInput, answer_reward, batch_reward,
                                             get_reward_fn, isolated_reward, reads_answer,
                                             register_reward, takes_answer_key)
from megatron_rlhf.rlhf.rewards.rules import concise, format_bullets, no_e, token_parity
from megatron_rlhf.rlhf.rewards.scorer import RewardScorer, score_samples
from megatron_rlhf.rlhf.rewards.verifiers import MissingAnswerError, math_reward

__all__ = [
    "REWARD_FUNCTIONS", "MissingAnswerError", "RewardConfigError", "RewardError", "RewardFn",
    "RewardInput", "RewardScorer", "answer_reward", "batch_reward", "concise", "format_bullets",
    "get_reward_fn", "isolated_reward", "math_reward", "no_e", "reads_answer", "register_reward",
    "score_samples", "takes_answer_key", "token_parity",
]
