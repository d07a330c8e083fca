"""Generation: the batched, tensor-parallel generator with lossless speculative decoding.

Entry point: :class:`~megatron_rlhf.generation.engine.Generator`. By concern: the call and
its rounds (``call``, ``rounds``, ``lookup``, ``drafting``), the cached forward
(``incremental``, ``attention``, ``cpu_numerics``, ``rope``, ``packing``, ``kv_cache``),
sampling and verification (``sampling``, ``rng``, ``speculative``), drafting sources
(``history``, ``draft``), the selector (``strategy``, ``costs``), CUDA graphs (``graphs``)
and migration between data-parallel ranks (``migration``).
"""
