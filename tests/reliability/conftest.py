import sys
from pathlib import Path

# the served-engine and update harnesses live with the engine and update tests
TESTS = Path(__file__).parents[1]
sys.path[:0] = [str(TESTS / "engine"), str(TESTS / "update")]
