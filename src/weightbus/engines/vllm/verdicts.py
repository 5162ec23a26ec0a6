"""Every rank of a vLLM engine learns every rank's verdict on a push before anything is loaded.

The exchange is one all-gather of fixed-size byte tensors on vLLM's own CPU TP group (gloo):
byte 0 is the rank's ok flag, the rest its reason in UTF-8. No pickle (unlike
`all_gather_object`).
"""

import torch
import torch.distributed as dist

REASON_BYTES = 2048


def _encode(ok: bool, reason: str) -> torch.Tensor:
    payload = reason.encode()[:REASON_BYTES]
    buffer = torch.zeros(1 + REASON_BYTES, dtype=torch.uint8)
    buffer[0] = int(ok)
    if payload:
        buffer[1 : 1 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buffer


def _decode(buffer: torch.Tensor) -> tuple[bool, str]:
    raw = bytes(buffer[1:].numpy()).rstrip(b"\0")
    return bool(buffer[0]), raw.decode(errors="replace")


def gather_verdicts(
    ok: bool, reason: str, group: dist.ProcessGroup | None
) -> list[tuple[bool, str]]:
    """`(ok, reason)` of every rank, in rank order (this rank's alone when `group` is None)."""
    if group is None or dist.get_world_size(group) == 1:
        return [(ok, reason)]
    mine = _encode(ok, reason)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [_decode(buffer) for buffer in everyone]
