"""The worker methods a vLLM server started with
`--worker-extension-cls weightbus.engines.vllm.extension.WeightbusWorkerExtension` adds to each
worker, for `POST /collective_rpc` (dev mode): vLLM has no route that reads a weight-transfer
backend's state, so this is how a publisher (or anyone) asks each worker what it holds.

- `weightbus_state`: per worker, the weightbus version it serves (version, step, fingerprint of
  what it received, verified and loaded), the one staged for a two-phase commit, the previous
  one held for a rollback (or why none), and its staging memory.
- `weightbus_layout`: per worker, the part of each checkpoint tensor it receives
  (`[name, dim, start, length]`; today every tensor whole).
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


class WeightbusWorkerExtension:
    """Mixed into vLLM's worker class by vLLM (`worker_extension_cls`): each public method is
    a `collective_rpc` method, answered by every worker."""

    def weightbus_state(self) -> dict:
        return _backend(self).state()

    def weightbus_layout(self) -> list[list]:
        return _backend(self).layout()
