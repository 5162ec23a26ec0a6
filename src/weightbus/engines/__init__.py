"""The engines the library feeds: `reference/` (weightbus's own tensor-parallel engine, its
models, layers and HTTP server) and `vllm/` (backend `weightbus` for vLLM, trainer and worker side
together). Each imports the library only, never the apps, and neither imports the other.
"""
