"""Logging set-up: rank and pid live in the formatter, not in every message (STYLE.md)."""

import logging
import os

_FORMAT = "%(asctime)s %(levelname)s [rank %(rank)s pid %(process)d] %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: str) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(rank: int | str = "-", level: int | str | None = None) -> None:
    """Configure the root logger of this process.

    Args:
        rank: tensor-parallel rank shown in every line ("-" outside an engine worker).
        level: log level; defaults to the WEIGHTBUS_LOG_LEVEL environment variable or INFO.
    """
    level = level or os.environ.get("WEIGHTBUS_LOG_LEVEL", "INFO")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(_RankFilter(str(rank)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
