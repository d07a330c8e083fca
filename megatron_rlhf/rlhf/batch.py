"""The one batch container of the RLHF loop: a rollout turned into training experience.

Sequences are packed as ``[prompt, left-padded to P | response, right-padded to T]``, so
every response starts at column ``P`` and the logits at column ``P - 1 + t`` predict
response token ``t``. All per-token fields are ``[B, T]`` over response positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rlhf import platform
from megatron_rlhf.config import GenerationConfig


@dataclass
class Experience:
    """Everything PPO needs about ``B`` sampled responses."""

    input_ids: Tensor          # [B, P+T] prompt (left-padded) then response (right-padded)
    attention_mask: Tensor     # [B, P+T] 1 at real tokens
    response_mask: Tensor      # [B, T] 1 at response tokens (EOS included), float
    old_logprobs: Tensor       # [B, T] log pi_old(a_t | s_t), the actor that generated
    ref_logprobs: Tensor       # [B, T] log pi_ref(a_t | s_t)
    scores: Tensor             # [B] reward of the whole response (at its last token)
    kl: Tensor                 # [B, T] per-token KL(pi_old || pi_ref) estimate
    advantages: Tensor         # [B, T] A_t (0 at padding)
    values: Tensor | None = None   # [B, T] V_old(s_t) from the critic (gae only)
    returns: Tensor | None = None  # [B, T] critic targets A_t + V_t (gae only)
    loss_weights: Tensor | None = None  # [B, T] weight of each token's loss (set per mini-batch)
    # The sampling settings that define the policy every log-prob here is under and PPO
    # trains (losses.policy_logits); None: the model's own distribution at temperature 1.
    policy: GenerationConfig | None = None

    @property
    def prompt_len(self) -> int:
        """``P``: the column where responses start."""
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    @property
    def response_ids(self) -> Tensor:
        """``[B, T]`` the sampled tokens."""
        return self.input_ids[:, self.prompt_len:]

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx) -> "Experience":
        """The rows ``idx`` (a slice, index list or tensor)."""
        fields = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            fields[f.name] = v[idx] if isinstance(v, Tensor) else v
        return Experience(**fields)

    def split(self, size: int) -> list["Experience"]:
        """Consecutive chunks of ``size`` rows (the last may be smaller)."""
        return [self.select(slice(i, i + size)) for i in range(0, self.batch_size, size)]


def pack(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device=None):
    """``(input_ids [B, P+T], attention_mask [B, P+T], response_mask [B, T])`` on ``device``
    (default: this rank's): prompts left-padded to the longest, responses right-padded."""
    p = max(len(x) for x in prompts)
    t = max(1, max(len(x) for x in responses))
    prompt_ids = platform.padded(prompts, pad_id, torch.long, device, width=p, left=True)
    response_ids = platform.padded(responses, pad_id, torch.long, device, width=t)
    lens = platform.padded([[len(x), len(y)] for x, y in zip(prompts, responses)], 0, torch.long, device)
    cols = torch.arange(p + t, device=lens.device)
    att = ((cols >= p - lens[:, :1]) & (cols < p + lens[:, 1:])).long()
    return torch.cat([prompt_ids, response_ids], 1), att, att[:, p:].float()


def response_slice(full: Tensor, exp: Experience) -> Tensor:
    """Columns of a ``[B, P+T, ...]`` model output that predict the response tokens."""
    p, t = exp.prompt_len, exp.response_mask.shape[1]
    return full[:, p - 1:p + t - 1]


def last_token_index(exp: Experience) -> Tensor:
    """``[B]`` column (in ``input_ids``) of each response's last token (the prompt's last
    token for an empty response)."""
    return exp.prompt_len + exp.response_mask.sum(-1).long() - 1
