"""The roofline of `bench update`: the passes each push path makes over the model's bytes, this
machine's measured rate for each pass (timed in the same run, interleaved with the pushes), and
the lower bound they give.

Passes, for a model of B bytes:

- `copy`: B bytes copied into the engines' memory (twice through `shm` slots: packed, then
  unpacked by the ranks), at the memcpy floor's rate on every core;
- `hash`: xxh3 of B bytes on the publisher (2B with verify=full: each rank's slices too), in
  cache. `xxhash` holds the GIL, so these seconds add up on one core whatever the threads;
- `check`: the NaN/inf test of B bytes: in cache inside the copy (atomic pushes), or a pre-pass
  from memory before the stream (in place);
- `verify`: each engine rank's digest and NaN/inf check of what it received (verify=full), from
  memory.

The bound is the largest of: the floor, the GIL's serial hash seconds, and every pass's
CPU-seconds spread over the cores; plus the pre-pass, which runs before anything else.
"""

from dataclasses import dataclass

import torch

from weightbus.core.digest import checked_digest, tensor_digest
from weightbus.core.finite import holds_nonfinite
from weightbus.core.plan.bucket import CHUNK_BYTES

# the rows `rate_operations` adds to a run (per-thread rates: the copy loop runs one per core)
HASH_IN_CACHE = "pass: xxh3 in cache, 1 thread"
CHECK_IN_CACHE = "pass: NaN check in cache, 1 thread"
VERIFY_FROM_MEMORY = "pass: digest + NaN check from memory, 1 thread"


@dataclass(frozen=True, slots=True)
class PathPasses:
    """What one push path does to a model of `nbytes` bytes (see the module docstring)."""

    copies: int  # times the bytes are copied (1 direct, 2 through slots)
    hashes: int  # times the publisher hashes them
    check: str  # "in copy", "pre-pass" or "off"
    verify: bool  # the engine ranks digest and check what they received


@dataclass(frozen=True, slots=True)
class Rates:
    """Bytes per second of each pass, measured in the run."""

    copy_all_cores: float
    hash_one_core: float
    check_one_core: float
    prepass_all: float  # the Publisher's pre-pass as it runs (from memory)
    verify_one_core: float
    cores: int

    def bound_s(self, nbytes: int, path: PathPasses) -> float:
        """The lower bound of a push of `nbytes` bytes along `path`, in seconds."""
        floor_s = path.copies * nbytes / self.copy_all_cores
        hash_s = path.hashes * nbytes / self.hash_one_core
        cpu_s = floor_s * self.cores + hash_s
        cpu_s += nbytes / self.check_one_core if path.check == "in copy" else 0.0
        cpu_s += nbytes / self.verify_one_core if path.verify else 0.0
        prepass_s = nbytes / self.prepass_all if path.check == "pre-pass" else 0.0
        return max(floor_s, hash_s, cpu_s / self.cores) + prepass_s


def rate_operations(weights: list) -> list[tuple[str, int, object]]:
    """`(name, nbytes, fn)` rows timing each pass on one thread, over as many bytes as the
    model holds: a `CHUNK_BYTES` bf16 chunk hashed or checked again and again (in cache, as the
    copy loop does it), and the engines' verify pass over the weights themselves (from memory)."""
    nbytes = sum(tensor.nbytes for _, tensor in weights)
    chunk = torch.randn(CHUNK_BYTES // 2).to(torch.bfloat16)
    rounds = max(1, nbytes // chunk.nbytes)

    def hash_in_cache() -> None:
        for _ in range(rounds):
            tensor_digest(chunk)

    def check_in_cache() -> None:
        for _ in range(rounds):
            holds_nonfinite(chunk)

    def verify_from_memory() -> None:
        for _, tensor in weights:
            checked_digest(tensor, check_nonfinite=True)

    return [
        (HASH_IN_CACHE, rounds * chunk.nbytes, hash_in_cache),
        (CHECK_IN_CACHE, rounds * chunk.nbytes, check_in_cache),
        (VERIFY_FROM_MEMORY, nbytes, verify_from_memory),
    ]
