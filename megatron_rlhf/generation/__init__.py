"""Generation: KV cache and incremental forward, sampling with keyed uniforms, lossless
speculative decoding with a draft model, the workload-aware drafting selector, sample
migration between data-parallel ranks, and CUDA-graphed steps on GPU (:mod:`.engine`)."""
