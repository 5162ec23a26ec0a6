import sys
from pathlib import Path

# The served-engine harness and tiny HF checkpoints live with the engine tests.
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
