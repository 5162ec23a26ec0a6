"""`weightbus plan`'s byte counts against real pushes: for the tiny model and two Hugging Face
test models (tied embeddings, one KV head replicated on TP 2, biases, a vocabulary TP 2 does not
divide), pushed into a TP 2 and a TP 1 engine over `shm` (direct and slots), `nixl` and `dist`
(broadcast and parts), the planner's bytes per engine rank equal what each rank's transport
counted, and its trainer bytes what the publisher's sink counted."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from engine_harness import ServedEngine, make_hf_model
from safetensors.torch import load_file

from weightbus import Publisher
from weightbus.apps.capacity.shapes import model_tensors
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.capacity.traffic import traffic
from weightbus.core.meta import metas_of
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

if TYPE_CHECKING:
    from process_pool import SharedProcesses

pytestmark = pytest.mark.e2e

BUCKET_BYTES = 64 * 1024  # several buckets, the largest tensors in chunks
MODELS = ("tiny", "qwen2_tied_kv1_sharded", "llama_tied_bias_sharded")
TRANSPORTS = {
    "shm": ("shm", {"direct": True}),
    "shm-slots": ("shm", {"direct": False}),
    "nixl": ("nixl", {}),
    "dist-broadcast": ("dist", {"mode": "broadcast"}),
    "dist-parts": ("dist", {"mode": "parts"}),
}


def _tiny_hf_config() -> dict:
    """The built-in `tiny` model as a Hugging Face config."""
    tiny = tiny_config()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tiny.vocab_size,
        "hidden_size": tiny.hidden_size,
        "intermediate_size": tiny.intermediate_size,
        "num_hidden_layers": tiny.num_hidden_layers,
        "num_attention_heads": tiny.num_attention_heads,
        "num_key_value_heads": tiny.num_key_value_heads,
        "head_dim": tiny.head_dim,
        "tie_word_embeddings": tiny.tie_word_embeddings,
    }


@pytest.fixture(scope="module", params=MODELS)
def served(
    request, tmp_path_factory, shared_processes: "SharedProcesses"
) -> Iterator[tuple[Path, list, list[ServedEngine]]]:
    """A model's config directory, its weights, and a TP 2 and a TP 1 engine serving it. The
    tiny model's are the TP 2 and TP 1 engines other modules share (tests/process_pool.py):
    every push here carries the whole model and each test's counters are its own push's, so
    what those engines served before does not matter; the checkpoints' engines are started here."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "tiny":
        (folder / "config.json").write_text(json.dumps(_tiny_hf_config()))
        shared = [shared_processes.tiny_engine("--tp", str(tp), log_dir=folder) for tp in (2, 1)]
        yield folder, list(random_hf_weights(tiny_config(), seed=3)), shared
        return
    make_hf_model(request.param, folder)
    weights = sorted(
        (name, tensor)
        for path in sorted(folder.glob("*.safetensors"))
        for name, tensor in load_file(path).items()
    )
    engines: list[ServedEngine] = []
    try:
        for tp in (2, 1):
            log = folder / f"tp{tp}.log"
            engines.append(ServedEngine("--model", str(folder), "--tp", str(tp), log_path=log))
        yield folder, weights, engines
    finally:
        for engine in engines:
            engine.stop()


@pytest.mark.parametrize("path", list(TRANSPORTS))
def test_planned_bytes_equal_the_transports_counters(served, path: str) -> None:
    folder, weights, engines = served
    planned_model = model_tensors(folder, "float32")
    pushed = {(m.name, m.shape, m.dtype) for m in metas_of(weights)}
    assert {(m.name, m.shape, m.dtype) for m in planned_model.metas} == pushed
    transport, options = TRANSPORTS[path]
    urls = [engine.url for engine in engines]
    with Publisher(
        urls,
        transport=transport,
        bucket_bytes=BUCKET_BYTES,
        timeout_s=60,
        transport_options=options,
    ) as publisher:
        if transport == "dist":
            publisher.init_weights_group("127.0.0.1", timeout_s=30)
        result = publisher.push(weights, version=f"plan-{path}-{folder.name}", atomic=False)
    plans = [
        traffic(planned_model, EngineLayout(tp), path, bucket_bytes=BUCKET_BYTES) for tp in (2, 1)
    ]
    assert [list(plan.receive_bytes) for plan in plans] == [e.rank_nbytes for e in result.engines]
    if path in ("dist-broadcast", "shm-slots"):  # written once for both engines
        assert plans[0].trainer_send_bytes == (result.sent_bytes,)
    else:
        assert sum(plan.trainer_send_bytes[0] for plan in plans) == result.sent_bytes
    assert plans[0].share_bytes[0] < planned_model.total_bytes  # TP 2 really split something
