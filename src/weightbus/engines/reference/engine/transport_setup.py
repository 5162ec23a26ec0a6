"""A rank's side of `/v1/setup_transport` and `/v1/teardown_transport` (and of their SGLang
names for `dist`, `/v1/init_weights_group` and `/v1/destroy_weights_group`).

Rank 0 accepts a `TransportSetup` as a `SetupOrder` (the message and its typed request); every
rank starts it at the same step boundary (`Action.TRANSPORT_SETUP`) through the transport's
rank set-up (`weightbus.core.transport.rank_setup`), in a background thread (`SetupChange`): a
set-up may wait for other parties (a weights group forms once every member joined) within the
request's `wait_s()`, and the engine generates meanwhile. Each step rank 0 polls
(`Action.SETUP_POLL`); once every rank is done, the outcomes (`RankResult`s) are all-gathered
like an update's verdicts, so rank 0 answers once for the engine. Nothing here knows a
transport: the request's hooks (`RankSetupRequest`) give the bounds and the words.
"""

import threading
import time
from dataclasses import dataclass

from weightbus.core.receiver import RankResult
from weightbus.core.transport import RankSetupRequest, decode_setup_request, rank_setup
from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.models.served import ServedModels


def slice_specs(model: ServedModels) -> list[SliceSpec]:
    """This rank's slice of every full tensor (its `shard_copies`, as wire data); a tensor it
    holds no part of (another rank's expert) has a slice of length 0."""
    specs = [
        SliceSpec(hf_name, copy.src_dim, copy.src_start, copy.length)
        for hf_name, _, copy in model.shard_copies()
    ]
    held = {spec.name for spec in specs}
    return specs + [SliceSpec(name, 0, 0, 0) for name in model.weight_shapes() if name not in held]


@dataclass(frozen=True, slots=True)
class SetupOrder:
    """A transport set-up rank 0 accepted: the message (its id, the request as sent) and the
    typed request (`decode_setup_request`)."""

    message: messages.TransportSetup
    request: RankSetupRequest

    @classmethod
    def decode(cls, message: messages.TransportSetup) -> "SetupOrder":
        """The order of `message`.

        Raises:
            ValueError: unknown transport, one without rank set-up, or an invalid request
                (`ProtocolError`).
        """
        return cls(message, decode_setup_request(message.transport, message.request))


def apply_transport_setup(
    order: SetupOrder, tp_rank: int, tp_size: int, slices: list[SliceSpec]
) -> RankResult:
    """Run the transport's rank set-up with the order's request; never raises, the result says
    what failed."""
    result = RankResult()
    try:
        setup = rank_setup(order.message.transport)
        setup(order.request, tp_rank=tp_rank, tp_size=tp_size, slices=slices)
    except TimeoutError as exc:
        result.timed_out = True
        result.fail(str(exc))
    except (OSError, ValueError, RuntimeError) as exc:
        result.fail(str(exc))
    return result


# A rank gives up on a set-up this long after the request's `wait_s()`: a set-up may block in a
# call it cannot bound (torch's TCPStore client does not bound its handshake, so a store that
# accepts connections and never answers would hold the thread for ever; it is left behind, a
# daemon).
SETUP_GRACE_S = 5.0


class SetupChange:
    """`apply_transport_setup` running in a background thread; `outcome` once it ended or gave
    up."""

    def __init__(
        self, order: SetupOrder, tp_rank: int, tp_size: int, slices: list[SliceSpec]
    ) -> None:
        self.order = order
        self.result: RankResult | None = None
        self._bound_s = order.request.wait_s() + SETUP_GRACE_S
        self._deadline = time.monotonic() + self._bound_s
        self._thread = threading.Thread(
            target=self._run, args=(tp_rank, tp_size, slices), name="transport-setup", daemon=True
        )
        self._thread.start()

    def _run(self, tp_rank: int, tp_size: int, slices: list[SliceSpec]) -> None:
        self.result = apply_transport_setup(self.order, tp_rank, tp_size, slices)

    def outcome(self) -> RankResult | None:
        """The result, a timed-out one once the deadline passed, or None while it runs."""
        if self.result is not None or time.monotonic() < self._deadline:
            return self.result
        given_up = RankResult()
        given_up.timed_out = True
        given_up.fail(self.order.request.stalled_message(self._bound_s))
        return given_up
