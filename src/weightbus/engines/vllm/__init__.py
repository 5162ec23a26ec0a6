"""weightbus as a vLLM weight-transfer backend (`--weight-transfer-config '{"backend":
"weightbus"}'`).

`register` is the `vllm.general_plugins` entry point: vLLM runs it in every process it starts
(API server, engine core, workers), and it registers backend `weightbus` on both of vLLM's
factories, lazily (nothing here imports vLLM until vLLM asks for the backend):

- worker side, `WeightTransferEngineFactory`: `worker.WeightbusWeightTransferEngine` receives a
  whole push over a weightbus transport, verifies every digest, and only then loads it through
  vLLM's layerwise reload (`reload.py`);
- trainer side, `WeightTransferTrainerFactory`: `trainer.WeightbusTrainerEngine`, for users who
  drive vLLM through its own trainer API.

Trainers that use weightbus's `Publisher` push to a vLLM server with
`weightbus.engines.vllm.target.VllmEngineTarget` instead (docs/vllm.md).
"""

import logging

logger = logging.getLogger(__name__)

BACKEND = "weightbus"
# `--worker-extension-cls` of a vLLM server whose workers answer `weightbus_state` and
# `weightbus_layout` on `/collective_rpc` (extension.py): what a target reads back.
WORKER_EXTENSION = f"{__name__}.extension.WeightbusWorkerExtension"


def register() -> None:
    """Register backend `weightbus` with vLLM (idempotent: vLLM may load plugins twice)."""
    from vllm.distributed.weight_transfer import factory

    for registry, module, name in (
        (
            factory.WeightTransferEngineFactory,
            f"{__name__}.worker",
            "WeightbusWeightTransferEngine",
        ),
        (factory.WeightTransferTrainerFactory, f"{__name__}.trainer", "WeightbusTrainerEngine"),
    ):
        try:
            registry.register_engine(BACKEND, module, name)
        except ValueError:
            logger.debug("%s already has backend %r", registry.__name__, BACKEND)
