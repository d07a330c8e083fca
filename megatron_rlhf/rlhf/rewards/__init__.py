"""Reward functions, registered by name, and the scorer that runs them over a batch.

``base`` (types, registry, marks, errors) imports nothing from the package; ``timer`` and
``pool`` know only a callable and a timeout; ``outcome`` and ``scorer`` run a function over a
batch; ``rules`` and ``verifiers`` register the built-in functions on import.
"""

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
