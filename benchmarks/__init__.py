"""Benchmarks of megatron_rlhf, one module each: ``python -m benchmarks.NAME --help`` from the repository root."""
