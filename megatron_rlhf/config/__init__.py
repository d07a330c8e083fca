"""Config dataclasses, one module per component, validated in ``__post_init__``.

The library takes these, never ``args``. Errors are :class:`ConfigError` naming fields; the
CLI (:mod:`megatron_rlhf.flags`) generates its flags from the fields and names the flags.
"""

from __future__ import annotations

import dataclasses

from megatron_rlhf.config.errors import ConfigError
from megatron_rlhf.config.finetune import (
    FINETUNE_LOSSES,
    FinetuneConfig,
    FinetuneOptimConfig,
    PreferenceConfig,
)
from megatron_rlhf.config.generation import (
    DRAFT_SOURCES,
    HISTORY_LONG_BOOST,
    SPEC_VERIFY,
    GenerationConfig,
    MigrationConfig,
    SpecConfig,
)
from megatron_rlhf.config.loop import EvalConfig, LoopConfig, OptimConfig, RewardConfig
from megatron_rlhf.config.model import (
    FAMILIES,
    MOE_FAMILIES,
    PRESETS,
    ROLES,
    ROPE_SCALING_KEYS,
    VOCAB_PAD_MULTIPLE,
    ModelConfig,
    check_role,
    preset,
)
from megatron_rlhf.config.parallel import MODEL_LAYOUTS, SUBSET_MODELS, ParallelConfig, PrecisionConfig
from megatron_rlhf.config.ppo import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, PPOConfig

# Every config dataclass.
CONFIGS = (ParallelConfig, PrecisionConfig, GenerationConfig, SpecConfig, MigrationConfig, PPOConfig,
           OptimConfig, LoopConfig, RewardConfig, EvalConfig, FinetuneConfig, PreferenceConfig,
           FinetuneOptimConfig, ModelConfig)


def dataclass_from_namespace(cls, namespace, **extra):
    """Build ``cls`` from the attributes of ``namespace`` that share its field names (None: the default)."""
    values = {
        f.name: getattr(namespace, f.name)
        for f in dataclasses.fields(cls)
        if getattr(namespace, f.name, None) is not None
    }
    values.update(extra)
    return cls(**values)


__all__ = [
    "ConfigError", "CONFIGS", "ModelConfig", "ParallelConfig", "PrecisionConfig", "GenerationConfig",
    "SpecConfig", "MigrationConfig", "PPOConfig", "OptimConfig", "LoopConfig", "RewardConfig",
    "EvalConfig", "FinetuneConfig", "PreferenceConfig", "FinetuneOptimConfig", "FINETUNE_LOSSES",
    "ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "LOSS_AGGREGATIONS", "SPEC_VERIFY", "DRAFT_SOURCES",
    "HISTORY_LONG_BOOST", "MODEL_LAYOUTS", "SUBSET_MODELS", "FAMILIES", "MOE_FAMILIES", "PRESETS", "ROLES",
    "ROPE_SCALING_KEYS", "VOCAB_PAD_MULTIPLE", "preset", "check_role", "dataclass_from_namespace",
]
