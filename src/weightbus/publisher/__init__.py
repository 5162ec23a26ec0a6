"""Trainer side of an update."""

from weightbus.publisher.weights import SessionFactory, normalize_weights

__all__ = ["SessionFactory", "normalize_weights"]
