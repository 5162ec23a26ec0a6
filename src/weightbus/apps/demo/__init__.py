"""`weightbus demo`: a small RL loop pushing every step's weights into a live engine."""
