"""Engine side of an update: consume a transport's batches, verify, load."""

from weightbus.core.receiver.delta import SliceWriter
from weightbus.core.receiver.receiver import RankResult, Receiver

__all__ = ["RankResult", "Receiver", "SliceWriter"]
