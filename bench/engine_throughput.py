"""Reference-engine throughput (tokens/s at batch 1 and 16, TP 1 and 2) for `tiny`.

Same as `weightbus bench engine`; run: `.venv/bin/python bench/engine_throughput.py`.
"""

from weightbus.apps.bench.engine import main

if __name__ == "__main__":
    raise SystemExit(main())
