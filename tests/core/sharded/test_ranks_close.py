"""The leader's `TrainerRanks.close`: it keeps its store up until every rank read the last
outcome it announced; it does not wait for a round that ended before it led it (a rank's
weights refused in `hold`: no outcome, so no rank reads one), nor for a rank it waited for in
vain in that round (dead or stuck)."""

import logging
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from weightbus.core.publisher import ranks as ranks_module
from weightbus.core.publisher.ranks import TrainerRanks
from weightbus.core.trainer.group import TrainerGroup, TrainerRankError

CLOSE_WAIT_S = 0.5  # the test's `_CLOSE_WAIT_S`


class _Store:
    """The part of a `TCPStore` a group uses, in this process: the leader's view, with no
    other rank ever writing."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def get(self, key: str) -> bytes:
        return self._values[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self._values for key in keys)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self.check(keys), timeout.total_seconds()):
                raise dist.DistStoreError("wait timed out")

    def delete_key(self, key: str) -> bool:
        return self._values.pop(key, None) is not None


@pytest.fixture
def leader(monkeypatch: pytest.MonkeyPatch) -> TrainerRanks:
    monkeypatch.setattr(ranks_module, "_CLOSE_WAIT_S", CLOSE_WAIT_S)
    return TrainerRanks(TrainerGroup(_Store(), rank=0, world_size=2))


def _closed_in(leader: TrainerRanks) -> float:
    start = time.monotonic()
    leader.close()
    return time.monotonic() - start


def test_a_round_refused_before_it_was_led_is_not_waited_for(leader, caplog):
    round_ = leader.begin(timeout_s=30)
    leader.refuse_failure(round_, ValueError("not whole 128x128 blocks"))
    with caplog.at_level(logging.WARNING):
        assert _closed_in(leader) < CLOSE_WAIT_S / 2
    assert "closing the trainer group's store anyway" not in caplog.text


def _rank_1_silent(leader: TrainerRanks) -> None:
    """A round in which rank 1 never reports its part (dead): the leader announces the failure."""
    round_ = leader.begin(timeout_s=30)

    def lead() -> None:
        leader.group.collect(f"{round_.key}/done", "its part", time.monotonic() + 0.05)

    with pytest.raises(TrainerRankError, match="trainer rank 1 sent no its part in time"):
        leader.lead(round_, lead)


def test_a_rank_waited_for_in_vain_is_not_waited_for_again(leader, caplog):
    _rank_1_silent(leader)
    with caplog.at_level(logging.WARNING):
        assert _closed_in(leader) < CLOSE_WAIT_S / 2
    assert "closing the trainer group's store anyway" not in caplog.text


def test_an_announced_outcome_is_waited_for_until_every_rank_read_it(leader, caplog):
    _rank_1_silent(leader)
    round_ = leader.begin(timeout_s=30)  # rank 1 is not silent in this one: it is waited for
    assert leader.lead(round_, lambda: "pushed") == "pushed"
    leader.refuse_failure(leader.begin(timeout_s=30), ValueError("refused"))  # the next round
    with caplog.at_level(logging.WARNING):  # rank 1 never reads the announced outcome
        assert _closed_in(leader) >= CLOSE_WAIT_S
    assert "rank 1 sent no read of the outcome in time" in caplog.text
