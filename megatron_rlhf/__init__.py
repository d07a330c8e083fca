"""megatron_rlhf: RLHF training of Llama-family models on megatron-core.

Importing the package has no side effects: the CPU shim, process groups and seeds are
set up by explicit calls (:mod:`megatron_rlhf.runtime`).
"""

__version__ = "0.1.0"
