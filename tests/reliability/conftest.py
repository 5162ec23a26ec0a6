import sys
from pathlib import Path

# the served-engine and update harnesses live with the engine and update tests
sys.path[:0] = [str(Path(__file__).parents[1] / "engine"), str(Path(__file__).parents[1] / "update")]
