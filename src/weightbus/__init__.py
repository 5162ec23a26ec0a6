"""weightbus: fast, exact, versioned weight updates from RL trainers into live inference engines."""

__version__ = "0.1.0"
