"""The floor of a `nixl` push (benchmarks): plain WRITEs of each engine rank's share, from one
registered buffer, into the same ranks' memory at once."""

import time
from collections.abc import Sequence
from typing import Any

import torch

from weightbus.core.transport.nixl.agent import Agent
from weightbus.core.transport.nixl.writes import POLL_PAUSE_S


def plain_writes_seconds(
    agent: Agent, key: str, shares: Sequence[tuple[str, int, int]], timeout_s: float
) -> float:
    """The seconds one WRITE per share takes, all posted at once: `shares` are (the engine
    rank's agent, where its memory starts, bytes), every agent already loaded into `agent`;
    `key` names the source buffer's registration meanwhile.

    Raises:
        RuntimeError, TimeoutError: a WRITE failed or did not complete in time.
    """
    source = torch.ones(max(nbytes for _, _, nbytes in shares), dtype=torch.uint8)
    agent.register(key, source)
    nixl = agent.nixl
    try:
        handles = [
            nixl.initialize_xfer(
                "WRITE",
                nixl.get_xfer_descs([(source.data_ptr(), nbytes, 0)], "DRAM"),
                nixl.get_xfer_descs([(address, nbytes, 0)], "DRAM"),
                remote,
            )
            for remote, address, nbytes in shares
        ]
        start = time.perf_counter()
        for handle in handles:
            nixl.transfer(handle)
        _wait_all(nixl, handles, start + timeout_s)
        return time.perf_counter() - start
    finally:
        agent.forget(key)


def _wait_all(nixl: Any, handles: list, deadline: float) -> None:
    """Until every transfer completed, then release them."""
    try:
        while any(nixl.check_xfer_state(handle) == "PROC" for handle in handles):
            if time.perf_counter() > deadline:
                raise TimeoutError("nixl: raw writes not complete in time")
            time.sleep(POLL_PAUSE_S)
        if any(nixl.check_xfer_state(handle) != "DONE" for handle in handles):
            raise RuntimeError("nixl: a raw write failed")
    finally:
        for handle in handles:
            handle.release()
