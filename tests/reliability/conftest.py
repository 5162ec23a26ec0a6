import sys
from pathlib import Path

# The served-engine harness, tiny HF checkpoints and update helpers live with those tests.
TESTS = Path(__file__).parents[1]
sys.path[:0] = [str(TESTS / "engine"), str(TESTS / "update")]
