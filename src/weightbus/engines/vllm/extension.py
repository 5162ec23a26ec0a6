"""The worker methods a vLLM server started with
`--worker-extension-cls weightbus.engines.vllm.extension.WeightbusWorkerExtension` adds to each
worker, for `POST /collective_rpc` (dev mode): vLLM has no route that reads a weight-transfer
backend's state, so this is how a publisher (or anyone) asks each worker what it holds.

- `weightbus_state`: per worker, the weightbus version it serves (version, step, fingerprint of
  what it received, verified and loaded), the one staged for a two-phase commit, the previous
  one held for a rollback (or why none), its staging memory, and whether a weightbus load ever
  touched vLLM's weights (`touched`: until then vLLM serves what it started with).
- `weightbus_layout`: per worker, the part of each checkpoint tensor it receives
  (`[name, dim, start, length]`: its slice, or the whole tensor).

Neither raises: a failure is answered as `{"error": ...}` by every worker. vLLM's executor
reads the workers' answers in rank order and stops at the first that raised, leaving the
others queued for the next call, which would then read this one's answers.
"""

from typing import Any

NOT_WEIGHTBUS = (
    "this vLLM server's weight-transfer backend is not weightbus (start it with "
    '--weight-transfer-config \'{"backend": "weightbus"}\')'
)


def _backend(worker: Any) -> Any:
    """The worker's weightbus backend.

    Raises:
        TypeError: the server runs another backend, or none.
    """
    from weightbus.engines.vllm.worker import WeightbusWeightTransferEngine

    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, WeightbusWeightTransferEngine):
        raise TypeError(NOT_WEIGHTBUS)
    return engine


def _answer(worker: Any, method: str) -> Any:
    try:
        return getattr(_backend(worker), method)()
    except Exception as exc:  # noqa: BLE001 - every failure must be an answer, never a raise
        return {"error": f"{type(exc).__name__}: {exc}"}


class WeightbusWorkerExtension:
    """Mixed into vLLM's worker class by vLLM (`worker_extension_cls`): each public method is
    a `collective_rpc` method, answered by every worker."""

    def weightbus_state(self) -> dict:
        return _answer(self, "state")

    def weightbus_layout(self) -> list[list] | dict:
        return _answer(self, "layout")
