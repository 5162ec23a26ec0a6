"""Import paths from before the three wings (core, engines, apps) keep working.

`import weightbus.publisher` or `from weightbus.ray import RayFleet` resolve to the module's new
home (`weightbus.core.publisher`, `weightbus.apps.ray`): the same module object, not a copy, so
`isinstance` checks and module state are shared. New code uses the new paths
(docs/development.md, "Import paths").
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

# old dotted prefix -> new one; the longest matching prefix wins
MOVED: dict[str, str] = {
    "weightbus.publisher.targets.vllm": "weightbus.engines.vllm.target",
    "weightbus.publisher.cli": "weightbus.apps.push",
    "weightbus.integrations.vllm": "weightbus.engines.vllm",
    "weightbus.transport.dist": "weightbus.core.transport.distributed",
    # the sharded trainer's parts, before one Publisher served every layout
    **{
        f"weightbus.core.sharded.{name}": f"weightbus.core.trainer.{new}"
        for name, new in (
            ("holdings", "holdings"), ("boxes", "boxes"), ("layout", "layout"),
            ("control", "group"), ("digests", "digests"), ("schedule", "cells"),
            ("quantize", "quantize"),
        )
    },
    "weightbus.core.sharded.publisher": "weightbus.core.sharded",
    **{
        f"weightbus.transport.{name}": f"weightbus.core.transport.parts.{name}"
        for name in (
            "arena", "layout", "copy", "deadlines", "shared_memory", "direct_channel", "prefetch",
        )
    },
    **{
        f"weightbus.{name}": f"weightbus.core.{name}"
        for name in (
            "plan", "wire", "digest", "meta", "transport", "receiver", "publisher", "delta",
            "checkpoint", "owners", "store", "units", "log",
        )
    },
    **{
        f"weightbus.{name}": f"weightbus.engines.reference.{name}"
        for name in ("engine", "models", "layers", "server")
    },
    **{
        f"weightbus.{name}": f"weightbus.apps.{name}"
        for name in ("bench", "demo", "capacity", "ray", "tables", "cli")
    },
}  # fmt: skip


def new_name(old: str) -> str | None:
    """The module's name in the wings, or None if `old` did not move."""
    for prefix in sorted(MOVED, key=len, reverse=True):
        if old == prefix or old.startswith(prefix + "."):
            return MOVED[prefix] + old[len(prefix) :]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.target_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.target_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module ran under its new name already; the import system replaced its
        `__spec__` with the alias's, which is put back."""
        module.__spec__ = self.target_spec


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds an old module path and hands out the module at its new one."""

    def find_spec(self, fullname: str, path=None, target=None):  # importlib's signature
        target_name = new_name(fullname)
        if target_name is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(target_name))


def install() -> None:
    """Put the finder first on `sys.meta_path`, once (idempotent): an old path's submodules
    would otherwise be found again through the new package's `__path__`, as a second copy."""
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
