"""`weightbus serve`: the reference engine's command."""

import argparse
import os
import sys

from weightbus.engines.reference.models.config import LORA_DTYPES
from weightbus.engines.reference.models.experts import PLACEMENTS
from weightbus.engines.reference.models.loader import QUANTIZATIONS
from weightbus.engines.reference.server.launcher import DTYPES, ServeConfig

TOKEN_ENV = "WEIGHTBUS_API_TOKEN"  # noqa: S105 - the variable's name, not a secret


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve", help="serve a model over HTTP with the tensor-parallel reference engine"
    )
    parser.add_argument("--model", default="tiny", help="'tiny' or a Hugging Face directory")
    parser.add_argument("--tp", type=int, default=1, dest="tp_size", help="tensor-parallel ranks")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="fp8-block: serve the decoder-layer matrices in block FP8 (float8_e4m3fn and a "
        "float32 scale per 128x128 block), quantizing an unquantized checkpoint as it loads; "
        "an FP8 checkpoint's quantization_config is read without it",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="serve LoRA adapters of this rank, pushed with Publisher.push(..., adapter=...) "
        "and applied unmerged to the base (docs/lora.md); 0: none",
    )
    parser.add_argument(
        "--lora-targets",
        default=None,
        help="comma-separated projections the adapters target (default: q_proj, k_proj, "
        "v_proj, o_proj, gate_proj, up_proj, down_proj)",
    )
    parser.add_argument(
        "--lora-dtype",
        default="float32",
        choices=LORA_DTYPES,
        help="what adapters are held and applied in (float32: peft's default on a bf16 or "
        "fp16 base); pushed adapters must have it",
    )
    parser.add_argument(
        "--expert-parallel",
        action="store_true",
        help="mixture-of-experts models: whole experts per rank (EP size = --tp, attention "
        "still TP) instead of every expert split over the ranks",
    )
    parser.add_argument(
        "--expert-placement",
        default="linear",
        choices=PLACEMENTS,
        help="with --expert-parallel: rank r holds a contiguous range of experts (linear) or "
        "expert e sits on rank e %% tp (round_robin)",
    )
    parser.add_argument(
        "--redundant-experts",
        type=int,
        default=0,
        help="with --expert-parallel: extra slots holding second copies of experts (each "
        "rank's j-th extra slot holds the j-th expert it lacks); tokens alternate between "
        "copies",
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="sequences in a batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--api-token",
        default=None,
        help=f"bearer token the admin routes require (default: ${TOKEN_ENV}; the variable keeps "
        "it out of the process list); needed to bind a non-loopback --host",
    )
    parser.add_argument(
        "--no-shm-weights",
        dest="shm_weights",
        action="store_false",
        help="keep parameters in private memory: co-located shm pushes then stream through "
        "slots instead of writing straight into the parameters (direct mode)",
    )
    parser.add_argument(
        "--wait-for-initial-weights",
        action="store_true",
        help="serve no completions (503, status WAITING) until a version is pushed: for an "
        "engine joining a fleet from any checkpoint",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        help="speculative decoding: 'tiny' or a Hugging Face directory of a draft model with "
        "the model's vocabulary; pushes carry its tensors under 'draft.' (docs/speculative.md)",
    )
    parser.add_argument(
        "--draft-seed",
        type=int,
        default=None,
        help="seed of a tiny draft's weights (default --seed)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="tokens the draft proposes per step, verified by the model in one forward pass",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of prompt prefixes that other requests computed under the weights "
        "served (blocks of 16 tokens; a push drops it; off with a draft model), docs/serving.md",
    )
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop (as on SIGTERM) when the process that started this one exits, even by "
        "SIGKILL: for engines a script starts, which must not outlive it",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from weightbus.engines.reference.process_exit import exit_now
    from weightbus.engines.reference.server.launcher import serve

    # an empty --api-token is an error (ServeConfig); an empty variable means "not set"
    token = args.api_token if args.api_token is not None else os.environ.get(TOKEN_ENV) or None
    try:
        config = ServeConfig(
            model=args.model,
            tp_size=args.tp_size,
            host=args.host,
            port=args.port,
            dtype=args.dtype,
            quantization=args.quantization,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            seed=args.seed,
            served_model_name=args.served_model_name,
            api_token=token,
            shm_weights=args.shm_weights,
            exit_with_parent=args.exit_with_parent,
            wait_for_initial_weights=args.wait_for_initial_weights,
            draft_model=args.draft_model,
            draft_seed=args.draft_seed,
            num_speculative_tokens=args.num_speculative_tokens,
            lora_rank=args.lora_rank,
            lora_targets=tuple(args.lora_targets.split(",")) if args.lora_targets else (),
            lora_dtype=args.lora_dtype,
            expert_parallel=args.expert_parallel,
            expert_placement=args.expert_placement,
            redundant_experts=args.redundant_experts,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        code = serve(config, on_ready=_print_url)
    except (ValueError, OSError) as exc:
        print(f"weightbus serve: error: {exc}", file=sys.stderr)
        return 2
    # stopped, everything it owns closed: exit without the interpreter's teardown
    return exit_now(code)


def _print_url(url: str) -> None:
    print(f"weightbus: serving on {url}", flush=True)
