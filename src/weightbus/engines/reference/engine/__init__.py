"""The reference engine's runtime: sequences, scheduler, KV cache, sampler, per-rank worker."""
