"""`weightbus bench fp8`: a bf16 trainer pushing to a bf16 engine and to a block-FP8 engine
(quantized in the push), same run, same weights.

Two real engines (`weightbus serve --tp N --dtype bfloat16`, the second with `--quantization
fp8-block`) on Llama-shaped bf16 weights of `--size`. Rows, round-robin for `--repeat` rounds
after an untimed warm-up round (`measure_interleaved`):

- `memcpy floor`: the bf16 bytes copied into a preallocated buffer;
- `quantize`: block-FP8 quantization of every decoder-layer matrix (`quantize_weights`), the
  cost a quantizing push adds on the trainer;
- `bf16 push` and `fp8 push` over `shm`, atomic: the push's bytes (`PushResult.nbytes`) and
  seconds (the FP8 push includes its quantization).

Every push must leave its engine serving the pushed fingerprint, else the run fails.
"""

import argparse
import tempfile
from pathlib import Path

import torch

from weightbus.apps.bench.dist import write_model
from weightbus.apps.bench.llama_weights import llama_weights
from weightbus.apps.bench.timing import Measurement, measure_interleaved, write_json
from weightbus.apps.launch import start_engine, stop_engine
from weightbus.apps.tables import print_table
from weightbus.core.fp8 import Fp8Block, quantize_weights
from weightbus.core.publisher import Publisher
from weightbus.core.units import format_bytes, parse_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("256MiB"))
    parser.add_argument("--tp", type=int, default=1, help="engine tensor-parallel ranks")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None, help="write every sample here")


class _Pushes:
    """One publisher per engine; each call pushes the weights as a new version."""

    def __init__(self, publisher: Publisher, weights: list) -> None:
        self.publisher, self.weights, self.count, self.last = publisher, weights, 0, None

    def __call__(self) -> None:
        self.count += 1
        self.last = self.publisher.push(self.weights, version=f"bench-{self.count}")
        served = [e.fingerprint for e in self.last.engines]
        if served != [self.last.fingerprint]:
            raise RuntimeError(f"an engine serves {served}, not {self.last.fingerprint}")


def run(args: argparse.Namespace) -> int:
    weights = llama_weights(args.size, torch.bfloat16)
    model_bytes = sum(t.nbytes for _, t in weights)
    floor_source = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in weights])
    floor_target = torch.empty_like(floor_source)
    engines = []
    with tempfile.TemporaryDirectory(prefix="weightbus-bench-fp8-") as tmp:
        model_dir = write_model(weights, args.size, Path(tmp))
        try:
            engines += [
                start_engine(str(model_dir), args.tp, extra=["--dtype", "bfloat16", *extra])
                for extra in ([], ["--quantization", "fp8-block"])
            ]
            (_, bf16_url), (_, fp8_url) = engines
            with (
                Publisher([bf16_url], transport="shm") as bf16,
                Publisher([fp8_url], transport="shm", quantize="fp8-block") as fp8,
            ):
                bf16_push, fp8_push = _Pushes(bf16, weights), _Pushes(fp8, weights)
                rows = measure_interleaved(
                    [
                        ("memcpy floor", model_bytes, lambda: floor_target.copy_(floor_source)),
                        (
                            "quantize",
                            model_bytes,
                            lambda: dict(quantize_weights(weights, Fp8Block())),
                        ),
                        ("bf16 push", model_bytes, bf16_push),
                        ("fp8 push", model_bytes, fp8_push),
                    ],
                    args.repeat,
                )
                wire = {"bf16 push": bf16_push.last.nbytes, "fp8 push": fp8_push.last.nbytes}
        finally:
            for proc, _ in engines:
                stop_engine(proc)
    _report(rows, wire, model_bytes, args)
    return 0


def _report(rows: list[Measurement], wire: dict[str, int], model_bytes: int, args) -> None:
    floor = rows[0].median_s
    print(f"bf16 weights: {format_bytes(model_bytes)}, engines at TP {args.tp}, shm, atomic")
    print_table(
        ["row", "bytes pushed", "median s", "x floor"],
        [
            [
                m.name,
                format_bytes(wire.get(m.name, model_bytes)),
                f"{m.median_s:.3f}",
                f"{m.median_s / floor:.1f}",
            ]
            for m in rows
        ],
    )
    bf16, fp8 = rows[2].median_s, rows[3].median_s
    print(
        f"fp8 push / bf16 push: bytes {wire['fp8 push'] / wire['bf16 push']:.2f}x, "
        f"time {fp8 / bf16:.2f}x"
    )
    if args.json:
        write_json(args.json, {"rows": rows, "bytes_pushed": wire, "model_bytes": model_bytes})
