"""A generation request checked against the models' configs before any model runs or any
collective starts (Megatron's rule for bad input: fail early, say what to change):
:func:`check_request` for the prompts, lengths and drafting settings, :func:`check_draft`
for a draft model beside its actor. Entry points call them on the checkpoints' configs
alone; :class:`~megatron_rlhf.generation.engine.Generator` calls them on every request."""

from __future__ import annotations

from megatron_rlhf.config import GenerationConfig, SpecConfig


def check_draft(actor_cfg, draft_cfg) -> None:
    """Raises ValueError unless the draft shares the actor's vocabulary (and a feature
    draft its hidden width)."""
    if draft_cfg.vocab_size != actor_cfg.vocab_size:
        raise ValueError(
            f"the draft's vocabulary ({draft_cfg.vocab_size} tokens) differs from the actor's "
            f"({actor_cfg.vocab_size}): a draft must share the actor's tokenizer"
        )
    if draft_cfg.feature_draft and draft_cfg.hidden_size != actor_cfg.hidden_size:
        raise ValueError(
            f"the feature draft reads hidden states of width {draft_cfg.hidden_size}, the actor's "
            f"are {actor_cfg.hidden_size}: distil the draft from this actor (tools/train_draft.py)"
        )


def check_request(prompts: list[list[int]], cfg: GenerationConfig, spec: SpecConfig,
                  actor_cfg, draft_cfg=None, allow_empty: bool = False, history: bool = False) -> int:
    """Validate a request against the model configs (no models, no collectives); returns the
    KV-cache length it needs, raises ValueError saying what to change."""
    if not prompts and not allow_empty:
        raise ValueError("no prompts to generate from")
    if not spec.auto and spec.num_draft_tokens and draft_cfg is None and not history:
        raise ValueError("--num-draft-tokens > 0 needs a draft: a draft model (--draft-load) "
                         "or --draft-source history")
    if draft_cfg is not None:
        check_draft(actor_cfg, draft_cfg)
    limit = actor_cfg.max_position_embeddings
    if draft_cfg is not None:
        limit = min(limit, draft_cfg.max_position_embeddings)
    extra = spec.base_tokens(draft_cfg is not None or history) + 1  # longer drafts fit where room is left
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if len(p) + cfg.max_new_tokens + extra > limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens: with max_new_tokens {cfg.max_new_tokens} "
                f"(+{extra} for verification) it exceeds the cache of {limit} positions; "
                "shorten the prompt or lower --max-new-tokens"
            )
    longest = max((len(p) for p in prompts), default=0)
    for c in (actor_cfg, draft_cfg):
        if c is not None:
            c.check_attention_span(longest + cfg.max_new_tokens)
    return longest + cfg.max_new_tokens + extra
