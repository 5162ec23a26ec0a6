"""LoRA adapter pushes: the adapter's matrices travel, the base the engines serve stays.

An adapter push (`Pushes.push_adapter`) is one `PushRun` of the adapter's tensors, each rank
sending its shards of them, whose order carries an `AdapterSpec` (rank, alpha, targets, the
base's fingerprint): engines serving another base
refuse it (409) before a byte moves, and each reports the fingerprint of base and adapter
together (`served_fingerprint`). Removing the adapter pushes zeros of its shapes with
`active` off: the engines serve the base alone again and report its fingerprint. Adapters go
whole, never as deltas: an adapter is a small share of the model's bytes.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from weightbus.core.lora import adapter_spec
from weightbus.core.meta import TensorMeta
from weightbus.core.wire.adapter import AdapterSpec

NO_BASE = (
    "an adapter push needs the fingerprint of the base model it was trained on: push the base "
    "first, or pass base_fingerprint=publisher.fingerprint(base_weights)"
)
NO_ADAPTER = "no adapter was pushed by this Publisher: nothing to remove"


@dataclass
class AdapterState:
    """What the fleet's engines serve as base and adapter, as this Publisher pushed them.

    Attributes:
        base_fingerprint: the base model's (its last whole push, `set_delta_base`, or the
            base of its last adapter push).
        shapes: the last adapter pushed, as `(name, shape, dtype)` (None: none pushed).
        spec: its description.
        previous: the state before the last push landed (what a rollback serves again).
    """

    base_fingerprint: str | None = None
    shapes: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None
    spec: AdapterSpec | None = None
    previous: "AdapterState | None" = None

    def spec_for(self, config: Any, base_fingerprint: str | None) -> AdapterSpec:
        """The push's description of an adapter with peft config `config`.

        Raises:
            ValueError: no base fingerprint is known; see `adapter_spec`.
        """
        base = base_fingerprint or self.base_fingerprint
        if base is None:
            raise ValueError(NO_BASE)
        return adapter_spec(config, base)

    def removal(self) -> tuple[dict[str, torch.Tensor], AdapterSpec]:
        """Zeros of the last adapter's shapes, and its spec with `active` off, on the base the
        engines serve now (a whole push since may have replaced it).

        Raises:
            ValueError: no adapter was pushed.
        """
        if self.shapes is None or self.spec is None or self.base_fingerprint is None:
            raise ValueError(NO_ADAPTER)
        zeros = {name: torch.zeros(shape, dtype=dtype) for name, shape, dtype in self.shapes}
        base = self.base_fingerprint
        return zeros, msgspec.structs.replace(self.spec, active=False, base_fingerprint=base)

    def committed(self, metas: list[TensorMeta], spec: AdapterSpec) -> None:
        """An adapter push committed: its base is the engines' (and the next adapter's by
        default); a removal keeps the shapes for the next one."""
        self._landed()
        self.base_fingerprint = spec.base_fingerprint
        self.shapes = [(meta.name, tuple(meta.shape), meta.dtype) for meta in metas]
        self.spec = spec

    def whole_pushed(self, fingerprint: str) -> None:
        """A whole version committed: it is the base of the next adapter."""
        self._landed()
        self.base_fingerprint = fingerprint

    def rolled_back(self, fingerprint: str) -> None:
        """The engines serve the version before the last push again (`fingerprint`); they swap,
        so a second rollback returns to the last push. With no push of this Publisher's to go
        back to, the version rolled back to is the next adapter's base."""
        if self.previous is None:
            self.whole_pushed(fingerprint)
            return
        now = dataclasses.replace(self, previous=None)
        restored = self.previous
        self.base_fingerprint = restored.base_fingerprint
        self.shapes, self.spec, self.previous = restored.shapes, restored.spec, now

    def _landed(self) -> None:
        self.previous = dataclasses.replace(self, previous=None)
