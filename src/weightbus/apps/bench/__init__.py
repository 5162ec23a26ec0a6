"""Benchmarks behind `weightbus bench`: each measures a floor and baselines in the same run."""
