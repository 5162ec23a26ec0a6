"""`weightbus bench lora`: a LoRA adapter pushed alone vs merged into the model and pushed
whole, same run, same weights; and what merging into bf16 weights costs numerically.

Two real engines (`weightbus serve --tp N --dtype bfloat16`) on Llama-shaped bf16 weights of
`--size`: one started with `--lora-rank R` receives the adapter (rank `--rank` on all seven
projections, `lora_alpha` 2r) and applies it unmerged; the other receives the merged model.
Rows, round-robin for `--repeat` rounds after an untimed warm-up round (`measure_interleaved`):

- `memcpy floor, adapter` and `memcpy floor, model`: each byte count copied into a
  preallocated buffer;
- `adapter push`: `Publisher.push(adapter, adapter=config)` over `shm`, atomic;
- `merge`: the trainer's merge, `W + scaling * B @ A` for every adapted matrix as peft's merge
  computes it (B @ A in float32, rounded to bf16, added in bf16), into new tensors: the
  trainer keeps its unmerged base to train on;
- `merged push`: the merged model pushed whole over `shm`, atomic.

Every push must leave its engine serving the pushed fingerprint, else the run fails. The
report also says how each push travelled (`shm direct` or `shm slots`) and the bytes each
engine rank received.

Then, on the `tiny` architecture in peft and transformers (no engine), for adapters whose
update is 10%, 1% and 0.1% of the weights' RMS (`MergeError`): the largest logit error of a
bf16 model with the adapter merged into its weights (peft's `merge_and_unload`) and with it
applied unmerged, both against the float32 forward of the same bf16 base with the adapter
unmerged; how far the adapter moves those logits at all; and the share of the update that
rounding the merged weights to bf16 loses.
"""

import argparse
import copy
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from weightbus.apps.bench.dist import write_model
from weightbus.apps.bench.llama_weights import LlamaShape, llama_shape, llama_weights
from weightbus.apps.bench.timing import Measurement, measure_interleaved, write_json
from weightbus.apps.launch import start_engine, stop_engine
from weightbus.apps.tables import print_table
from weightbus.core.publisher import Publisher, PushResult
from weightbus.core.units import format_bytes, parse_bytes
from weightbus.core.wire.adapter import (
    LORA_TARGETS,
    MAX_LORA_RANK,
    PEFT_PREFIX,
    adapter_names,
    hf_module,
)

ALPHA_PER_RANK = 2  # lora_alpha = 2 r, a common choice: scaling 2
# the adapter's update as a share of the base weights' RMS, for the numeric rows
UPDATE_SHARES = (0.1, 0.01, 0.001)
NUMERIC_TOKENS = (4, 64)  # batch, sequence length of the logits compared


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("256MiB"))
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (all seven projections)")
    parser.add_argument("--tp", type=int, default=1, help="engine tensor-parallel ranks")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None, help="write every sample here")


def lora_config(rank: int) -> dict:
    """The adapter's peft config, as `adapter_config.json` holds it."""
    return {"r": rank, "lora_alpha": ALPHA_PER_RANK * rank, "target_modules": "all-linear"}


def random_adapter(
    shape: LlamaShape, rank: int, dtype: torch.dtype, seed: int = 1
) -> dict[str, torch.Tensor]:
    """A rank-`rank` adapter on every projection of a Llama of `shape`, under peft's names:
    A as peft initialises it (kaiming-uniform, bound 1/sqrt(in)), B random (a trained one)."""
    generator = torch.Generator().manual_seed(seed)
    dense = dict(shape.tensor_shapes())
    adapter = {}
    for layer in range(shape.num_layers):
        for projection in LORA_TARGETS:
            out_features, in_features = dense[f"{hf_module(layer, projection)}.weight"]
            a_name, b_name = adapter_names(layer, projection)
            bound = in_features**-0.5
            a = (torch.rand(rank, in_features, generator=generator) * 2 - 1) * bound
            b = torch.randn(out_features, rank, generator=generator) * 0.01
            adapter[a_name], adapter[b_name] = a.to(dtype), b.to(dtype)
    return adapter


def merged_weights(
    weights: list[tuple[str, torch.Tensor]], adapter: dict[str, torch.Tensor], scaling: float
) -> list[tuple[str, torch.Tensor]]:
    """`weights` with `adapter` merged into new tensors, as peft's `merge` computes it on CPU:
    `W + (B @ A * scaling)`, the product in float32 rounded to the adapter's dtype, the sum in
    float32 rounded to W's dtype. Weights without an adapter are passed through."""
    merged = []
    for name, weight in weights:
        module = PEFT_PREFIX + name.removesuffix(".weight")
        a = adapter.get(f"{module}.lora_A.weight")
        if a is None:
            merged.append((name, weight))
            continue
        b = adapter[f"{module}.lora_B.weight"]
        merged.append((name, _merged(weight, a, b, scaling)))
    return merged


def _merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`weight + scaling * b @ a` in a new tensor, as peft's `merge` rounds it."""
    delta = (b.float() @ a.float() * scaling).to(b.dtype)
    if delta.dtype == weight.dtype:
        return weight + delta  # peft's `weight += delta`: the sum rounded once
    return (weight.float() + delta.float()).to(weight.dtype)


class _Pushes:
    """Each call pushes the same tensors as a new version and checks the engine serves them."""

    def __init__(self, push: Callable[[str], PushResult]) -> None:
        self.push, self.count, self.last = push, 0, None

    def __call__(self) -> None:
        self.count += 1
        self.last = self.push(f"bench-{self.count}")
        served = [e.fingerprint for e in self.last.engines]
        if served != [self.last.fingerprint]:
            raise RuntimeError(f"an engine serves {served}, not {self.last.fingerprint}")


def _floor(nbytes: int) -> Callable[[], object]:
    """A memcpy of `nbytes` into a preallocated buffer."""
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    return lambda: target.copy_(source)


def _start_engines(model_dir: Path, args: argparse.Namespace) -> list:
    """The LoRA engine and the plain one, started side by side: `[(proc, url), ...]`."""
    flags = [["--dtype", "bfloat16", "--lora-rank", str(args.rank)], ["--dtype", "bfloat16"]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(start_engine, str(model_dir), args.tp, extra=f) for f in flags]
    engines, errors = [], []
    for future in futures:
        try:
            engines.append(future.result())
        except RuntimeError as exc:
            errors.append(exc)
    if errors:
        for proc, _ in engines:
            stop_engine(proc)
        raise errors[0]
    return engines


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.rank <= MAX_LORA_RANK:
        print(
            f"weightbus bench lora: error: --rank must be in [1, {MAX_LORA_RANK}], got {args.rank}",
            file=sys.stderr,
        )
        return 2
    weights = llama_weights(args.size, torch.bfloat16)
    # float32, as peft keeps an adapter on a bf16 base (the engine's default --lora-dtype)
    adapter = random_adapter(llama_shape(args.size), args.rank, torch.float32)
    config = lora_config(args.rank)
    scaling = config["lora_alpha"] / args.rank
    merged = merged_weights(weights, adapter, scaling)
    with tempfile.TemporaryDirectory(prefix="weightbus-bench-lora-") as tmp:
        model_dir = write_model(weights, args.size, Path(tmp))
        engines = _start_engines(model_dir, args)
        try:
            (_, lora_url), (_, plain_url) = engines
            with (
                Publisher([lora_url], transport="shm") as lora_publisher,
                Publisher([plain_url], transport="shm") as plain_publisher,
            ):
                base = lora_publisher.fingerprint(weights)
                adapter_push = _Pushes(
                    lambda version: lora_publisher.push(
                        adapter, version=version, adapter=config, base_fingerprint=base
                    )
                )
                merged_push = _Pushes(lambda version: plain_publisher.push(merged, version=version))
                rows = _measure(
                    weights, adapter, scaling=scaling, adapter_push=adapter_push,
                    merged_push=merged_push, repeat=args.repeat,
                )  # fmt: skip
        finally:
            for proc, _ in engines:
                stop_engine(proc)
    pushes = {"adapter push": adapter_push.last, "merged push": merged_push.last}
    numeric = merge_errors(args.rank)
    _report(rows, pushes, numeric, args)
    return 0


def _measure(
    weights: list[tuple[str, torch.Tensor]],
    adapter: dict[str, torch.Tensor],
    *,
    scaling: float,
    adapter_push: _Pushes,
    merged_push: _Pushes,
    repeat: int,
) -> list[Measurement]:
    """The rows, interleaved (`measure_interleaved`)."""
    model_bytes = sum(t.nbytes for _, t in weights)
    adapter_bytes = sum(t.nbytes for t in adapter.values())
    return measure_interleaved(
        [
            ("memcpy floor, adapter", adapter_bytes, _floor(adapter_bytes)),
            ("adapter push", adapter_bytes, adapter_push),
            ("memcpy floor, model", model_bytes, _floor(model_bytes)),
            ("merge", model_bytes, lambda: merged_weights(weights, adapter, scaling)),
            ("merged push", model_bytes, merged_push),
        ],
        repeat,
    )


@dataclass(frozen=True, slots=True)
class MergeError:
    """What merging a LoRA adapter into bf16 weights costs, against applying it unmerged.

    The reference is the float32 forward of the bf16 base (its weights exactly) with the
    float32 adapter applied unmerged; logit errors are the largest |difference| from it.

    Attributes:
        update_share: the adapter update's RMS over the base weights' RMS, per matrix.
        adapter_effect: how far the adapter moves the reference's logits (the signal).
        unmerged_bf16: the bf16 base with the bf16 adapter applied unmerged (the engine's way).
        merged_bf16: the bf16 model with the adapter merged into its weights (peft's merge).
        merged_vs_unmerged: between the two bf16 models.
        update_lost: RMS of (merged weights - base - the float32 update) over the update's
            RMS, all adapted matrices together: the share of the update that rounding to bf16
            took away or distorted (1.0: as much error as the update itself).
        logit_scale: the largest |logit| of the reference.
    """

    update_share: float
    adapter_effect: float
    unmerged_bf16: float
    merged_bf16: float
    merged_vs_unmerged: float
    update_lost: float
    logit_scale: float


def merge_errors(rank: int, seed: int = 0) -> list[MergeError]:
    """`MergeError` of a rank-`rank` adapter on the `tiny` architecture, per `UPDATE_SHARES`."""
    return [_merge_error(rank, share, seed) for share in UPDATE_SHARES]


def _merge_error(rank: int, share: float, seed: int) -> MergeError:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from weightbus.apps.demo.trainer import hf_llama_config
    from weightbus.engines.reference.models.config import tiny_config

    torch.manual_seed(seed)
    hf_config = hf_llama_config(tiny_config())
    # a bf16 base (its weights rounded once), held in float32 for the reference
    base = LlamaForCausalLM(hf_config).to(torch.bfloat16).float().eval()
    peft_config = LoraConfig(**lora_config(rank), lora_dropout=0.0)
    reference = get_peft_model(base, peft_config).eval()
    _set_updates(reference, share)
    unmerged = copy.deepcopy(reference).to(torch.bfloat16)
    merged = copy.deepcopy(unmerged).merge_and_unload()
    ids = torch.randint(0, hf_config.vocab_size, NUMERIC_TOKENS)
    with torch.no_grad():
        expected = reference(ids).logits
        with reference.disable_adapter():
            base_logits = reference(ids).logits
        unmerged_logits, merged_logits = unmerged(ids).logits, merged(ids).logits
        return MergeError(
            update_share=share,
            adapter_effect=_max_error(base_logits, expected),
            unmerged_bf16=_max_error(unmerged_logits, expected),
            merged_bf16=_max_error(merged_logits, expected),
            merged_vs_unmerged=_max_error(merged_logits, unmerged_logits.float()),
            update_lost=_update_lost(reference, merged),
            logit_scale=float(expected.abs().max()),
        )


def _lora_layers(peft_model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The peft model's adapted layers, by module name."""
    from peft.tuners.lora import LoraLayer

    return {
        name: module for name, module in peft_model.named_modules() if isinstance(module, LoraLayer)
    }


def _set_updates(peft_model: torch.nn.Module, share: float) -> None:
    """Give every adapted matrix a random B whose update `scaling * B @ A` has an RMS of
    `share` times the matrix's own."""
    with torch.no_grad():
        for module in _lora_layers(peft_model).values():
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            b.normal_()
            update = module.scaling["default"] * b @ a
            rms = module.get_base_layer().weight.pow(2).mean().sqrt()
            b.mul_(share * rms / update.pow(2).mean().sqrt())


def _update_lost(reference: torch.nn.Module, merged: torch.nn.Module) -> float:
    """RMS of what the merged weights changed minus the float32 update, over the update's
    RMS, over every adapted matrix (`MergeError.update_lost`)."""
    merged_weights = dict(merged.named_parameters())
    error_sq = update_sq = 0.0
    with torch.no_grad():
        for name, module in _lora_layers(reference).items():
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            update = module.scaling["default"] * b @ a
            weight_name = name.removeprefix(PEFT_PREFIX) + ".weight"
            realized = merged_weights[weight_name].float() - module.get_base_layer().weight
            error_sq += float((realized - update).pow(2).sum())
            update_sq += float(update.pow(2).sum())
    return (error_sq / update_sq) ** 0.5


def _max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).abs().max())


def _report(
    rows: list[Measurement], pushes: dict[str, PushResult], numeric: list[MergeError], args
) -> None:
    """Print the rows, how each push travelled and the merge's errors; `args.json`: write them."""
    by_name = {m.name: m for m in rows}
    wire = {name: result.nbytes for name, result in pushes.items()}
    # how each push travelled, and the bytes each engine rank received
    travel = {
        name: {"mode": result.mode, "rank_bytes": result.engines[0].rank_nbytes}
        for name, result in pushes.items()
    }
    floors = {"adapter push": "memcpy floor, adapter", "merged push": "memcpy floor, model"}
    print(
        f"bf16 weights: {format_bytes(by_name['memcpy floor, model'].nbytes)}, LoRA rank "
        f"{args.rank} on {len(LORA_TARGETS)} projections, engines at TP {args.tp}, shm, atomic"
    )
    print_table(
        ["row", "bytes", "median s", "x its floor"],
        [
            [
                m.name,
                format_bytes(wire.get(m.name, m.nbytes)),
                f"{m.median_s:.4f}",
                f"{m.median_s / by_name[floors[m.name]].median_s:.1f}" if m.name in floors else "",
            ]
            for m in rows
        ],
    )
    adapter_s, merged_s = by_name["adapter push"].median_s, by_name["merged push"].median_s
    merge_s = by_name["merge"].median_s
    print(
        f"adapter push / merged push: bytes {wire['adapter push'] / wire['merged push']:.4f}x "
        f"(1/{wire['merged push'] / wire['adapter push']:.0f}), time {adapter_s / merged_s:.3f}x; "
        f"/ (merge + merged push): {adapter_s / (merge_s + merged_s):.3f}x"
    )
    for name, how in travel.items():
        received = ", ".join(format_bytes(n) for n in how["rank_bytes"])
        print(f"{name}: {how['mode']}, received per engine rank: {received}")
    print(
        "\nmerging into bf16 vs applying unmerged (tiny Llama, peft): max |logit error| against "
        "float32 (bf16 base, float32 adapter unmerged)"
    )
    print_table(
        [
            "update / W (RMS)", "adapter moves logits", "unmerged bf16", "merged bf16",
            "merged - unmerged", "update lost in merge", "max |logit|",
        ],
        [
            [
                f"{e.update_share:g}",
                f"{e.adapter_effect:.2e}",
                f"{e.unmerged_bf16:.2e}",
                f"{e.merged_bf16:.2e}",
                f"{e.merged_vs_unmerged:.2e}",
                f"{e.update_lost:.1%}",
                f"{e.logit_scale:.2f}",
            ]
            for e in numeric
        ],
    )  # fmt: skip
    if args.json:
        write_json(
            args.json,
            {
                "rows": rows,
                "bytes_pushed": wire,
                "travel": travel,
                "rank": args.rank,
                "merge_errors": [asdict(e) for e in numeric],
            },
        )
