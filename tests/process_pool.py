"""Servers that several test modules share (`SharedProcesses`, the `shared_processes` fixture of
tests/conftest.py)."""

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from engine_harness import ServedEngine

# The fixtures that use the shared tiny-model engines: `engine` (tests/conftest.py, the modules
# without an `HF_CASE`) and `engines` (tests/core/pushes: conftest.py, test_transfer_counters.py).
# Modules that borrow them besides (tests/apps: capacity/test_plan_matches_pushes.py,
# test_demo.py) need not be named: one that runs after the last user stops them at its end.
TINY_ENGINE_USERS = ("engine", "engines")
# The fixtures that use the shared engines of the tiny Qwen3-MoE (`moe_engine`):
# tests/core/pushes/test_moe_pushes.py, test_moe_trainer_ranks.py and
# tests/engines/reference/engine/test_expert_replacement.py (tests/apps/test_bench_moe.py
# borrows the EP 2 one while it is up)
MOE_ENGINE_USERS = ("moe_engines", "moe_ep2")
# Fixtures of later modules that use one of those engines, by its flags: that engine alone stays
# up until their last test (tests/integrations/test_trl.py trains an MoE policy into the one at
# EP 2 with redundant slots, test_expert_replacement.py's)
MOE_ENGINE_LATER_USERS = {
    ("--tp", "2", "--expert-parallel", "--redundant-experts", "2"): ("moe_policy_engine",),
}


class SharedProcesses:
    """Servers that several test modules share instead of each starting its own (start-ups are
    most of the suite's time): each is started on first use, keyed by what makes it (its
    flags), and stopped after the last module whose tests use one of the fixtures named as its
    users (`users`, fixture names; a fixture that other fixtures request counts for them).

    Only servers that the tests leave serving are shared: every test reads the state it starts
    from (`before = ...`) or pushes first, never assumes a fresh engine. Tests that need one
    (the initial version, a crash, the engine's own sockets or exit code) start their own.
    A shared engine found dead (its process exited) is started again.

    Args:
        items: the session's tests, in run order (after deselection).
    """

    def __init__(self, items: list[pytest.Item]) -> None:
        self._index = {item.nodeid: i for i, item in enumerate(items)}
        self._last_use: dict[str, int] = {}  # fixture name -> index of its last test
        for i, item in enumerate(items):
            for name in getattr(item, "fixturenames", ()):
                self._last_use[name] = i
        # key -> (the server, its users, what stops it)
        self._started: dict[Hashable, tuple[Any, frozenset[str], contextlib.ExitStack]] = {}
        self._moe_dir: Path | None = None

    def get(
        self,
        key: Hashable,
        users: Iterable[str],
        start: Callable[[], AbstractContextManager[Any]],
        alive: Callable[[Any], bool] = lambda _: True,
    ) -> Any:
        """The server `key`, entering `start()` (a context manager: its exit stops the server)
        when none is running or the one running is not `alive`."""
        if key in self._started:
            served, known, stack = self._started[key]
            if alive(served):
                self._started[key] = (served, known | frozenset(users), stack)
                return served
            self._close(key)
        stack = contextlib.ExitStack()
        with contextlib.ExitStack() as failed:
            failed.callback(stack.close)  # a start that raises leaves nothing behind
            served = stack.enter_context(start())
            failed.pop_all()
        self._started[key] = (served, frozenset(users), stack)
        return served

    def engine(self, *args: str, users: Iterable[str], log_dir: Path) -> "ServedEngine":
        """`weightbus serve *args` (tests/engines/reference/engine/engine_harness.py)."""
        from engine_harness import ServedEngine

        @contextlib.contextmanager
        def start() -> Iterator[ServedEngine]:
            name = "_".join(Path(arg).name.strip("-") for arg in args) or "default"
            served = ServedEngine(*args, log_path=log_dir / f"{name}.log")
            try:
                yield served
            finally:
                served.stop()

        return self.get(("serve", *args), users, start, lambda e: e.proc.poll() is None)

    def tiny_engine(self, *args: str, log_dir: Path) -> "ServedEngine":
        """`weightbus serve *args` on the tiny model (no `--model`), for `TINY_ENGINE_USERS`."""
        return self.engine(*args, users=TINY_ENGINE_USERS, log_dir=log_dir)

    def moe_engine(self, *args: str, log_dir: Path) -> "ServedEngine":
        """`weightbus serve --model <the tiny Qwen3-MoE> *args`, for `MOE_ENGINE_USERS` (and
        `MOE_ENGINE_LATER_USERS` of these flags): the checkpoint is `moe_checkpoint()`, made
        once."""
        model = str(self.moe_checkpoint())
        users = MOE_ENGINE_USERS + MOE_ENGINE_LATER_USERS.get(args, ())
        return self.engine("--model", model, *args, users=users, log_dir=log_dir)

    def moe_checkpoint(self) -> Path:
        """The tiny Qwen3-MoE checkpoint the shared MoE engines start from (engine_harness's
        `qwen3_moe` case, seed 0), saved once per session."""
        if self._moe_dir is None:
            from engine_harness import make_hf_model

            self._moe_dir = Path(tempfile.mkdtemp(prefix="weightbus-test-moe-"))
            make_hf_model("qwen3_moe", self._moe_dir)
        return self._moe_dir

    def release_after(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """Stop the servers no later test uses, once `item`'s module is done (its module-scoped
        fixtures may hold them until then)."""
        module = getattr(item, "module", None)
        if nextitem is not None and getattr(nextitem, "module", None) is module:
            return
        index = self._index.get(item.nodeid)
        if index is None:
            return
        for key, (_, users, _) in list(self._started.items()):
            if all(self._last_use.get(name, -1) <= index for name in users):
                self._close(key)

    def close_all(self) -> None:
        for key in list(self._started):
            self._close(key)
        if self._moe_dir is not None:
            shutil.rmtree(self._moe_dir, ignore_errors=True)

    def _close(self, key: Hashable) -> None:
        _, _, stack = self._started.pop(key)
        stack.close()
