"""megatron_rlhf: RLHF training of Llama-family models on megatron-core.

Importing the package has no side effects: :mod:`megatron_rlhf.runtime` sets up the rest."""

__version__ = "0.1.0"
