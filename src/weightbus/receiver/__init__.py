"""Engine side of an update: consume a transport's batches, verify, load."""

from weightbus.receiver.delta import SliceWriter
from weightbus.receiver.receiver import RankResult, Receiver, UpdateRequest

__all__ = ["RankResult", "Receiver", "SliceWriter", "UpdateRequest"]
