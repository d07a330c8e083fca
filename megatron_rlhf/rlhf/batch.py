"""The one batch container of the RLHF loop (:class:`Experience`) and its packing."""
# Sequences are [prompt, left-padded to P | response, right-padded to T]: every response
# starts at column P, and the logits at column P - 1 + t predict response token t.


from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rlhf.data.padding import padded
from megatron_rlhf.config import GenerationConfig
from megatron_rlhf.models.packed import Packed, pack_rows


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
    # [B, T] the generator's log-probs of the sampled tokens, where old_logprobs come from a
    # training forward (the train-inference mismatch; --rollout-is-cap)
    rollout_logprobs: Tensor | None = None
    # [B, P+T, layers, k] an MoE rollout's routes of each token (-1: none), which the actor's
    # forwards replay or compare with (models.routing; :func:`route_columns`)
    routes: Tensor | None = None
    # The sampling settings that define the policy every log-prob here is under and PPO
    # trains (policy.policy_logits); None: the model's own distribution at temperature 1.
    policy: GenerationConfig | None = None
    # A packed micro-batch's forward input (micro_batches(packed=True)); the rows above stay
    # padded for everything else. Not carried over by select or columns.
    packed: Packed | None = None

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
        fields["packed"] = None
        return Experience(**fields)

    def split(self, size: int) -> list["Experience"]:
        """Consecutive chunks of ``size`` rows (the last may be smaller)."""
        return [self.select(slice(i, i + size)) for i in range(0, self.batch_size, size)]

    def columns(self, prompt: int, response: int) -> "Experience":
        """The last ``prompt`` prompt columns and the first ``response`` response columns; the
        others must be padding in every row (positions count real tokens, so the forward is unchanged)."""
        p = self.prompt_len
        fields = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in SEQUENCE_FIELDS and v is not None:
                v = v[:, p - prompt:p + response]
            elif isinstance(v, Tensor) and v.dim() == 2:
                v = v[:, :response]
            fields[f.name] = v
        fields["packed"] = None
        return Experience(**fields)

    def micro_batches(self, size: int, one_width: bool = False, last: Tensor | None = None,
                      packed: bool = False, max_tokens: int | None = None,
                      multiple: int = 1) -> tuple[list["Experience"], Tensor]:
        """``(micro-batches, order)``: chunks of ``size`` rows, longest responses first, each cut
        to the columns its rows use (``one_width``: those any row uses, one shape for pipeline
        schedules); ``order[i]``: the row of ``self`` that is the ``i``-th over the chunks.
        ``last``: ``[B]`` bool, rows that come after all the others (each kind longest first),
        in chunks of their own.

        ``packed``: chunks of as many rows as fit ``max_tokens`` real tokens (None: ``size`` x
        the longest row), each with its :class:`~megatron_rlhf.models.packed.Packed` forward
        input, ``multiple`` tokens a multiple of (``one_width``: ``max_tokens`` each);
        ValueError for a row longer than ``max_tokens``."""
        p = self.prompt_len
        stats = [self.attention_mask[:, :p].sum(1), self.response_mask.sum(1).long()]
        if last is not None:
            stats.append(last.to(stats[0].device).long())
        lengths = torch.stack(stats, 1).tolist()  # [B, 2 or 3] (prompt, response, late), one host read
        rows = sorted(range(self.batch_size),
                      key=lambda i: (lengths[i][2:], -lengths[i][1], -lengths[i][0], i))
        tokens = [lengths[i][0] + lengths[i][1] for i in range(self.batch_size)]
        kinds = [lengths[i][2:] for i in rows]
        if packed:
            max_tokens = max_tokens or size * max(tokens)
            chunks = _fill(rows, [tokens[i] for i in rows], max_tokens, kinds)
        else:
            chunks = _fill(rows, [1] * len(rows), size, kinds)

        def extent(idx):  # (prompt, response) columns the rows use; one prompt column at least
            return (max(1, max(lengths[i][0] for i in idx)), max(1, max(lengths[i][1] for i in idx)))

        if one_width:
            widths = [extent(rows)] * len(chunks)
        else:
            widths = [extent(idx) for idx in chunks]
        dev = self.input_ids.device
        order = torch.tensor(rows, dtype=torch.long, device=dev)
        parts = [self.select(torch.tensor(idx, dtype=torch.long, device=dev)).columns(*w)
                 for idx, w in zip(chunks, widths)]
        if packed:
            for part, idx in zip(parts, chunks):
                part.packed = pack_rows(part.input_ids, part.attention_mask, [tokens[i] for i in idx],
                                        max_tokens if one_width else None, multiple)
        return parts, order


def _fill(rows: list[int], sizes: list[int], budget: int, kinds: list) -> list[list[int]]:
    """``rows`` in order, cut into runs of at most ``budget`` in ``sizes`` (each row's), and
    where their ``kinds`` change (so that the rows to come last fill chunks of their own)."""
    chunks, used, previous = [], budget, None
    for i, size, kind in zip(rows, sizes, kinds):
        if size > budget:
            raise ValueError(f"a sequence of {size} tokens exceeds the packed micro-batch's "
                             f"{budget}: raise --max-tokens-per-micro-batch to at least the longest "
                             "prompt + response")
        if used + size > budget or kind != previous:
            chunks.append([])
            used, previous = 0, kind
        chunks[-1].append(i)
        used += size
    return chunks


# the Experience fields over prompt and response columns (the other 2-D ones are per response token)
SEQUENCE_FIELDS = ("input_ids", "attention_mask", "routes")


def model_micro_batches(model, exp: Experience, size: int, max_tokens: int | None = None,
                        last: Tensor | None = None) -> tuple[list[Experience], Tensor]:
    """:meth:`Experience.micro_batches` as ``model`` runs them: one width under pipeline
    parallelism, packed where its attention takes packed rows (``max_tokens`` as there; 0: not
    packed), a multiple of TP tokens under sequence parallelism."""
    from megatron_rlhf.models import sequence_parallel
    from megatron_rlhf.models.packed import supports_packing
    from megatron_rlhf.models.pipeline import pipelined

    packed = max_tokens != 0 and supports_packing(model)
    return exp.micro_batches(size, pipelined(model), last, packed=packed, max_tokens=max_tokens,
                             multiple=sequence_parallel.padded_length(model, 1))


def in_row_order(parts: list[Tensor], order: Tensor, width: int | None = None) -> Tensor:
    """Per-row results of :meth:`Experience.micro_batches` (``[b]``, or ``[b, t]`` padded
    with 0 on the right to ``width``) back in the batch's row order."""
    if width is not None:
        parts = [torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in parts]
    out = torch.cat(parts)
    return out[torch.argsort(order.to(out.device))]


def pack(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device=None):
    """``(input_ids [B, P+T], attention_mask [B, P+T], response_mask [B, T])`` on ``device``
    (default: this rank's): prompts left-padded to the longest, responses right-padded."""
    p = max(len(x) for x in prompts)
    t = max(1, max(len(x) for x in responses))
    prompt_ids = padded(prompts, pad_id, torch.long, device, width=p, left=True)
    response_ids = padded(responses, pad_id, torch.long, device, width=t)
    lens = padded([[len(x), len(y)] for x, y in zip(prompts, responses)], 0, torch.long, device)
    cols = torch.arange(p + t, device=lens.device)
    att = ((cols >= p - lens[:, :1]) & (cols < p + lens[:, 1:])).long()
    return torch.cat([prompt_ids, response_ids], 1), att, att[:, p:].float()


def route_columns(prompts: list[list[int]], responses: list[list[int]], routes: list[Tensor],
                  width: int, device=None) -> Tensor:
    """``[B, P+T, layers, k]`` int16: each sample's routes (``routes[i]``: its first ``n``
    tokens', ``[n, layers, k]``) in :func:`pack`'s columns, -1 elsewhere (``width``: P+T)."""
    p = max(len(x) for x in prompts)
    out = torch.full((len(prompts), width, *routes[0].shape[1:]), -1, dtype=routes[0].dtype)
    for i, (prompt, response, r) in enumerate(zip(prompts, responses, routes)):
        n = min(r.shape[0], len(prompt) + len(response))  # (a round may feed past EOS)
        out[i, p - len(prompt):p - len(prompt) + n] = r[:n]
    return out.to(device)


def response_slice(full: Tensor, exp: Experience) -> Tensor:
    """``[B, T, ...]`` the columns of a model output that predict the response tokens, of a
    ``[B, P+T, ...]`` output or one over the last columns only; ValueError if it is too short."""
    p, t = exp.prompt_len, exp.response_mask.shape[1]
    start = p - 1 - (exp.input_ids.shape[1] - full.shape[1])
    if start < 0:
        raise ValueError(f"an output of {full.shape[1]} columns does not reach back to column {p - 1}, "
                         f"which predicts the first response token")
    return full[:, start:start + t]


def last_token_index(exp: Experience) -> Tensor:
    """``[B]`` column (in ``input_ids``) of each response's last token (the prompt's last
    token for an empty response)."""
    return exp.prompt_len + exp.response_mask.sum(-1).long() - 1
