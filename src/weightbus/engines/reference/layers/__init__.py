"""Tensor-parallel building blocks of the reference engine, in vLLM's vocabulary."""
