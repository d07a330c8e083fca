"""Generation: the smoke greedy loop now; KV cache, speculative decoding and migration next."""
