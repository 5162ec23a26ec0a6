"""The API server's link to rank 0: ZMQ `ipc://` sockets carrying `engine.messages` structs.

The API server binds both sockets in a private directory; rank 0 connects. One background task
reads rank 0's outputs and routes each token to the queue of its request.
"""

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from weightbus.engine import messages
from weightbus.engine.worker import ipc_addresses

logger = logging.getLogger(__name__)

# What a request's queue receives: (weight version, token), a rejection, or the engine's death.
QueueItem = tuple[str, messages.TokenOutput] | messages.RequestError | Exception


class EngineDeadError(RuntimeError):
    """The engine processes are gone; no request can complete."""


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
        self._pump_task: asyncio.Task | None = None
        self.ready: messages.Ready | None = None
        self.failure: str | None = None

    async def wait_ready(
        self, *, timeout_s: float, check: Callable[[], str | None]
    ) -> messages.Ready:
        """Wait for rank 0's `Ready`, then start routing outputs.

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
            if not isinstance(message, messages.Ready):
                logger.warning("ignoring %s before Ready", type(message).__name__)
                continue
            if message.protocol_version != messages.PROTOCOL_VERSION:
                raise EngineDeadError(
                    f"engine protocol {message.protocol_version}, "
                    f"server protocol {messages.PROTOCOL_VERSION}"
                )
            self.ready = message
            self._pump_task = asyncio.create_task(self._pump())
            return message

    async def _pump(self) -> None:
        while True:
            data = await self._outputs.recv()
            try:
                message = messages.decode_from_engine(data)
            except msgspec.DecodeError:
                logger.exception("dropping a malformed message from rank 0")
                continue
            if isinstance(message, messages.StepOutputs):
                for out in message.outputs:
                    queue = self._streams.get(out.request_id)
                    if queue is not None:  # None: aborted or timed out meanwhile
                        queue.put_nowait((message.weight_version, out))
            elif isinstance(message, messages.RequestError):
                queue = self._streams.get(message.request_id)
                if queue is not None:
                    queue.put_nowait(message)

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
