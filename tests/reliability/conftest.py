import sys
from pathlib import Path

# The served-engine harness, tiny HF checkpoints and update helpers live with those tests.
for folder in ("engine", "update"):
    sys.path.insert(0, str(Path(__file__).parents[1] / folder))
