"""LoRA adapter pushes: the adapter's matrices travel, the base the engines serve stays.

An adapter push is one `PushRun` of the adapter's tensors whose order carries an
`AdapterSpec` (rank, alpha, targets, the base's fingerprint): engines serving another base
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

from weightbus.core.finite import refuse_nonfinite
from weightbus.core.lora import adapter_spec, adapter_tensors, check_adapter
from weightbus.core.publisher.fleet import Fleet
from weightbus.core.publisher.push_session import PushRequest, PushRun
from weightbus.core.publisher.results import PushResult
from weightbus.core.publisher.session import SessionFactory, Weights
from weightbus.core.publisher.targets import PushOrder
from weightbus.core.transport.base import Progress
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
    """

    base_fingerprint: str | None = None
    shapes: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None
    spec: AdapterSpec | None = None

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

    def committed(self, tensors: dict[str, torch.Tensor], spec: AdapterSpec) -> None:
        """An adapter push committed: its base is the engines' (and the next adapter's by
        default); a removal keeps the shapes for the next one."""
        self.base_fingerprint = spec.base_fingerprint
        self.shapes = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
        self.spec = spec


def push_adapter(
    fleet: Fleet,
    *,
    sessions: SessionFactory,
    weights: Weights | dict[str, torch.Tensor],
    spec: AdapterSpec,
    options: PushOrder,
    progress: Progress | None,
) -> tuple[dict[str, torch.Tensor], PushResult]:
    """Push the adapter of `weights` (a `PeftModel` or an adapter's state dict) described by
    `spec`, as `options.version`.

    Returns:
        The adapter's tensors (peft's names) and the push's result (`adapter` set).

    Raises:
        ValueError: tensors that are not LoRA matrices, or not of `spec`'s targets and rank.
        NonFiniteWeightsError: NaN or inf in the adapter (unless `allow_nonfinite`).
        PushError: an engine refused (409: another base), failed or timed out.
    """
    tensors = adapter_tensors(weights)
    check_adapter(tensors, spec)
    if not options.allow_nonfinite:
        refuse_nonfinite(tensors.items())
    order = msgspec.structs.replace(options, adapter=spec)
    request = PushRequest(tensors, order.version, order.step, order, progress)
    result = PushRun(fleet, sessions, request).run()
    return tensors, dataclasses.replace(result, adapter=spec)
