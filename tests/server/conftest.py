import sys
from pathlib import Path

# the served-engine harness lives with the engine tests; reuse it rather than copy it
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
