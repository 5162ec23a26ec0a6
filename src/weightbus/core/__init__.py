"""The library: what moves a weight from a trainer into an engine's ranks, and checks it.

Follow a weight down: `publisher/` (trainer side) → `delta/` → `transport/` → `wire/` →
`digest.py` → `plan/` → `meta.py`, with `receiver/` on each engine rank. It imports neither the
engines nor the apps (`make test` checks it: pyproject.toml, `[tool.importlinter]`).
"""
