"""The API server's link to rank 0: ZMQ `ipc://` sockets carrying `engine.messages` structs.

The API server binds both sockets in a private directory; rank 0 connects. One background task
(`_pump`) reads rank 0's outputs and routes them:

- `StepOutputs` tokens, `RequestError` and `Aborted` go to the queue of each named request
  (a speculative step may bring several tokens of one request, in order); the step's draft
  token counts add to `num_draft_tokens` / `num_accepted_tokens` (`/metrics`);
- `UpdateResult` / `ControlResult` resolve the future that `update` / `control` await, keyed by
  the `update_id` / `request_id` the API server drew (a late or unknown id is logged, dropped);
- `WeightsState` replaces the mirror `GET /v1/weights` reads (it starts from `Ready`);
- `LayoutChanged` replaces the mirrors `GET /v1/weights/layout` and `GET /v1/experts` read
  (`rank_slices`, `experts`: they start from `Ready`).
"""

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TypeVar

import msgspec
import zmq
import zmq.asyncio

from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.worker import ipc_addresses

logger = logging.getLogger(__name__)

T = TypeVar("T")

# What a request's queue receives: (weight version, token), a rejection, the engine ending it,
# or the engine's death.
QueueItem = tuple[str, messages.TokenOutput] | messages.RequestError | messages.Aborted | Exception


class EngineDeadError(RuntimeError):
    """The engine processes are gone; no request can complete."""


def _checked_ready(message: messages.FromEngine) -> messages.Ready | None:
    """`message` if it is rank 0's `Ready` (None: another message, ignored).

    Raises:
        EngineDeadError: the engine speaks another protocol version.
    """
    if not isinstance(message, messages.Ready):
        logger.warning("ignoring %s before Ready", type(message).__name__)
        return None
    if message.protocol_version != messages.PROTOCOL_VERSION:
        raise EngineDeadError(
            f"engine protocol {message.protocol_version}, "
            f"server protocol {messages.PROTOCOL_VERSION}"
        )
    return message


class EngineClient:
    """Sends requests to rank 0 and streams their tokens back, per request.

    Args:
        ipc_dir: private directory for the sockets (created by the launcher).
    """

    def __init__(self, ipc_dir: str) -> None:
        requests_addr, outputs_addr = ipc_addresses(ipc_dir)
        self._context = zmq.asyncio.Context()
        self._requests = self._context.socket(zmq.PUSH)
        self._requests.bind(requests_addr)
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(outputs_addr)
        self._streams: dict[str, asyncio.Queue[QueueItem]] = {}
        self._updates: dict[str, asyncio.Future[messages.UpdateResult]] = {}
        self._controls: dict[str, asyncio.Future[messages.ControlResult]] = {}
        self._weights_changed = asyncio.Event()
        self._pump_task: asyncio.Task | None = None
        self.ready: messages.Ready | None = None
        self.weights: messages.WeightsState | None = None
        # each rank's slice map and the live expert map (None: a dense model), from Ready on
        self.rank_slices: list[list[SliceSpec]] = []
        self.experts: messages.ExpertsInfo | None = None
        self.failure: str | None = None
        # called with rank 0's `SettleWithPeers` (the server's `PeerResolver.settle`)
        self.on_settle: Callable[[messages.SettleWithPeers], None] | None = None
        # speculative decoding: draft tokens proposed and accepted since Ready
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # prefix caching: prompt tokens looked up and found in the cache since Ready
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    async def wait_ready(
        self, *, timeout_s: float, check: Callable[[], str | None]
    ) -> messages.Ready:
        """Wait for rank 0's `Ready` and the `WeightsState` it sends right after (so the
        server never reports weights it does not know yet, e.g. no fingerprint), then start
        routing outputs.

        Args:
            timeout_s: bound of the wait (model loading included).
            check: returns a reason to give up (a worker exited, a stop was requested).

        Raises:
            EngineDeadError: `check` gave a reason, or the protocol versions differ.
            TimeoutError: no `Ready` within `timeout_s`.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            reason = check()
            if reason is not None:
                raise EngineDeadError(reason)
            remaining_s = deadline - loop.time()
            if remaining_s <= 0:
                raise TimeoutError(f"engine not ready after {timeout_s:.0f} s")
            if not await self._outputs.poll(int(min(0.5, remaining_s) * 1000)):
                continue
            message = messages.decode_from_engine(await self._outputs.recv())
            if self.ready is None:
                self.ready = _checked_ready(message)
                if self.ready is not None:
                    self.rank_slices, self.experts = self.ready.rank_slices, self.ready.experts
                continue
            if not isinstance(message, messages.WeightsState):
                logger.warning("ignoring %s before the first WeightsState", type(message).__name__)
                continue
            self.weights = message
            self._pump_task = asyncio.create_task(self._pump())
            return self.ready

    async def _pump(self) -> None:
        while True:
            data = await self._outputs.recv()
            try:
                message = messages.decode_from_engine(data)
            except msgspec.DecodeError:
                logger.exception("dropping a malformed message from rank 0")
                continue
            self._route(message)

    def _route(self, message: messages.FromEngine) -> None:
        match message:
            case messages.StepOutputs():
                self.num_draft_tokens += message.num_draft_tokens
                self.num_accepted_tokens += message.num_accepted_tokens
                self.num_prefix_queries += message.num_prefix_queries
                self.num_prefix_hits += message.num_prefix_hits
                for out in message.outputs:
                    self._to_stream(out.request_id, (message.weight_version, out))
            case messages.RequestError():
                self._to_stream(message.request_id, message)
            case messages.Aborted():
                for request_id in message.request_ids:
                    self._to_stream(request_id, message)
            case messages.UpdateResult():
                _resolve(self._updates, message.update_id, message)
            case messages.ControlResult():
                _resolve(self._controls, message.request_id, message)
            case messages.WeightsState():
                self._set_weights(message)
            case messages.LayoutChanged():
                self.rank_slices, self.experts = message.rank_slices, message.experts
            case messages.SettleWithPeers() if self.on_settle is not None:
                self.on_settle(message)
            case _:
                logger.warning("ignoring %s after Ready", type(message).__name__)

    def _to_stream(self, request_id: str, item: QueueItem) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:  # None: aborted or timed out meanwhile
            queue.put_nowait(item)

    def _set_weights(self, state: messages.WeightsState) -> None:
        self.weights = state
        # wake every waiter of this change; later waiters wait for the next one
        changed, self._weights_changed = self._weights_changed, asyncio.Event()
        changed.set()

    async def wait_weights(
        self, predicate: Callable[[messages.WeightsState], bool], *, timeout_s: float
    ) -> bool:
        """Wait until the weights mirror satisfies `predicate`.

        Args:
            predicate: tested on the current mirror, then after every `WeightsState`.
            timeout_s: bound of the wait.

        Returns:
            Whether the mirror satisfied `predicate` within `timeout_s`.
        """
        try:
            async with asyncio.timeout(timeout_s):
                while self.weights is None or not predicate(self.weights):
                    await self._weights_changed.wait()
        except TimeoutError:
            return False
        return True

    async def update(
        self,
        message: messages.UpdateWeights | messages.Rollback | messages.Decide | messages.AskOutcome,
        *,
        timeout_s: float,
    ) -> messages.UpdateResult:
        """Send an update, rollback, two-phase decision or outcome question to rank 0 and wait
        for the `UpdateResult` of its id (`update_id`; a `Decide`'s or `AskOutcome`'s
        `request_id`).

        Args:
            message: the request, with a fresh id.
            timeout_s: bound of the wait for the answer.

        Returns:
            Rank 0's answer (any status code).

        Raises:
            EngineDeadError: the engine is gone, or died while the update ran.
            TimeoutError: no answer within `timeout_s`.
        """
        by_request = isinstance(message, messages.Decide | messages.AskOutcome)
        key = message.request_id if by_request else message.update_id
        return await self._call(self._updates, key, message, timeout_s)

    async def control(
        self,
        message: messages.Control | messages.TransportSetup | messages.PlaceExperts,
        *,
        timeout_s: float,
    ) -> messages.ControlResult:
        """Send a `Control`, `TransportSetup` or `PlaceExperts` to rank 0; wait for the
        `ControlResult` of its `request_id`.

        Args:
            message: the action, with a fresh `request_id`.
            timeout_s: bound of the wait for the answer.

        Returns:
            Rank 0's answer (any status code).

        Raises:
            EngineDeadError: the engine is gone, or died while the action ran.
            TimeoutError: no answer within `timeout_s`.
        """
        return await self._call(self._controls, message.request_id, message, timeout_s)

    async def _call(
        self,
        pending: dict[str, asyncio.Future[T]],
        key: str,
        message: messages.ToEngine,
        timeout_s: float,
    ) -> T:
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        assert key not in pending, f"id {key} is already waiting"
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        pending[key] = future
        try:
            async with asyncio.timeout(timeout_s):
                await self._requests.send(messages.encode(message))
                return await future
        finally:
            pending.pop(key, None)  # an answer arriving later is logged and dropped

    async def add(self, request: messages.AddRequest) -> asyncio.Queue[QueueItem]:
        """Submit a request; its tokens arrive on the returned queue.

        Raises:
            EngineDeadError: the engine is gone.
        """
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        queue: asyncio.Queue[QueueItem] = asyncio.Queue()
        self._streams[request.request_id] = queue
        await self._requests.send(messages.encode(request))
        return queue

    async def abort(self, request_id: str) -> None:
        """Stop a request in the engine and forget its queue."""
        self._streams.pop(request_id, None)
        if self.failure is None:
            await self._requests.send(messages.encode(messages.AbortRequest(request_id=request_id)))

    def release(self, request_id: str) -> None:
        """Forget a finished request's queue."""
        self._streams.pop(request_id, None)

    def fail(self, reason: str) -> None:
        """Mark the engine dead and wake every waiting request with `EngineDeadError`."""
        self.failure = reason
        for queue in self._streams.values():
            queue.put_nowait(EngineDeadError(reason))
        for future in [*self._updates.values(), *self._controls.values()]:
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    async def close(self) -> None:
        """Ask rank 0 to stop (when it is alive) and close the sockets."""
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump_task
        # rank 0 may be alive whatever happened; without a connected peer this is a no-op
        with contextlib.suppress(zmq.Again):
            await self._requests.send(messages.encode(messages.Shutdown()), zmq.NOBLOCK)
        self._requests.close(linger=1000)
        self._outputs.close(linger=0)
        self._context.term()


def _resolve(pending: dict[str, asyncio.Future[T]], key: str, result: T) -> None:
    future = pending.pop(key, None)
    if future is None or future.done():  # its waiter timed out, or a stray id
        logger.warning("dropping %s for unknown or expired id %s", type(result).__name__, key)
        return
    future.set_result(result)
