"""`ModelConfig`: the architecture facts the engine needs, read from a Hugging Face config.json."""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightbus.core.fixes import with_fix
from weightbus.core.fp8 import Fp8Block
from weightbus.core.wire.adapter import LORA_TARGETS, MAX_LORA_RANK
from weightbus.engines.reference.layers.rotary import ROPE_TYPES
from weightbus.engines.reference.models.experts import ExpertLayout, initial_expert_map

MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# q_norm / k_norm: an RMSNorm over each head's dimension of q and k, before rope
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
LORA_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class LoraShape:
    """The adapters an engine serves (`--lora-rank`, `--lora-targets`, `--lora-dtype`): rank
    `rank` on the projections `targets` (sorted) of every decoder layer, held in `dtype` (peft
    keeps adapters in float32 on a bf16 or fp16 base by default; the product is computed in
    it and added to the layer's output, as peft does).

    Raises:
        ValueError: a rank out of range, an unknown projection or dtype (the flag named).
    """

    rank: int
    targets: tuple[str, ...] = tuple(sorted(LORA_TARGETS))
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_LORA_RANK:
            raise ValueError(f"--lora-rank must be in [1, {MAX_LORA_RANK}], got {self.rank}")
        unknown = sorted(set(self.targets) - set(LORA_TARGETS))
        if unknown or not self.targets:
            raise ValueError(
                f"--lora-targets must name projections among {', '.join(LORA_TARGETS)}, got "
                f"{', '.join(self.targets) or 'none'}"
            )
        object.__setattr__(self, "targets", tuple(sorted(set(self.targets))))
        if self.dtype not in LORA_DTYPES:
            raise ValueError(f"--lora-dtype must be one of {LORA_DTYPES}, got {self.dtype!r}")

    def describe(self) -> str:
        return f"rank {self.rank} on {', '.join(self.targets)}"


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Qwen3-MoE).

    Field names follow Hugging Face's config.json; `eos_token_ids` is always a tuple. A
    mixture-of-experts model (`num_experts` > 0) has an MoE block in layer `i` unless `i` is
    in `mlp_only_layers` or `(i + 1) % decoder_sparse_step` is not 0 (transformers' rule).

    Raises:
        ValueError: a field is out of range or unsupported; the message names the field.
    """

    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_proj_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # block-FP8 decoder-layer matrices (`quantization_config`, or `--quantization fp8-block`)
    quantization: Fp8Block | None = None
    # LoRA adapters the engine serves (`--lora-rank`, `--lora-targets`); None: none
    lora: LoraShape | None = None
    # Qwen3: RMSNorm of each head of q and k before rope (`q_norm`, `k_norm`)
    qk_norm: bool = False
    # Qwen3-MoE: experts of the MoE layers (0: none, every layer dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # how the engine holds the experts (`--expert-parallel`, ...); None: split over TP ranks
    expert_layout: ExpertLayout | None = None

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported: {MODEL_TYPES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type {rope_type!r} is not supported: {ROPE_TYPES}")
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"eos_token_id {self.eos_token_ids} outside the vocabulary")
        self.eos_token_ids = tuple(self.eos_token_ids)
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        self._validate_experts()
        self.validate_options()

    def _validate_experts(self) -> None:
        if self.num_experts and self.model_type != "qwen3_moe":
            raise ValueError(f"num_experts: model_type {self.model_type} has no experts")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if any(not 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
            raise ValueError(
                f"mlp_only_layers {list(self.mlp_only_layers)} names layers outside "
                f"[0, {self.num_hidden_layers})"
            )
        if not self.num_experts:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts = {self.num_experts}], got "
                f"{self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size < 1:
            raise ValueError(
                f"moe_intermediate_size must be a positive integer, got "
                f"{self.moe_intermediate_size}"
            )

    def validate_options(self) -> None:
        """Check the serving options set on the config (`lora`, `expert_layout`) against
        the architecture.

        Raises:
            ValueError: naming the flag: expert parallelism on a model without experts, or
                LoRA on the MLP projections of a mixture-of-experts model.
        """
        layout, has_moe = self.expert_layout, bool(self.moe_layers)
        if layout is not None and layout.expert_parallel and not has_moe:
            raise ValueError(
                f"--expert-parallel needs a mixture-of-experts model: this {self.model_type} "
                "model has no MoE layer"
            )
        if not has_moe:
            return
        lora_targets = () if self.lora is None else self.lora.targets
        mlp_targets = sorted({"gate_proj", "up_proj", "down_proj"} & set(lora_targets))
        if mlp_targets:
            raise ValueError(
                f"--lora-targets {', '.join(mlp_targets)}: the experts of a mixture-of-experts "
                "model take no adapter; target the attention projections only"
            )

    @property
    def has_dense_mlp(self) -> bool:
        """Whether some decoder layer has a dense MLP (of `intermediate_size`)."""
        return len(self.moe_layers) < self.num_hidden_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the decoder layers with an MoE block (empty for a dense model)."""
        if not self.num_experts:
            return ()
        return tuple(
            i
            for i in range(self.num_hidden_layers)
            if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    def validate_tp(self, tp_size: int) -> None:
        """Check that the model can be split over `tp_size` ranks.

        Raises:
            ValueError: naming `--tp` and the model field that does not divide.
        """
        if tp_size < 1:
            raise ValueError(f"--tp must be >= 1, got {tp_size}")
        kv = self.num_key_value_heads
        checks = {
            "num_attention_heads": self.num_attention_heads % tp_size == 0,
            "num_key_value_heads": kv % tp_size == 0 or tp_size % kv == 0,
            "intermediate_size": self.intermediate_size % tp_size == 0,
            "vocab_size": self.vocab_size >= tp_size,
        }
        if not self.has_dense_mlp:
            del checks["intermediate_size"]
        layout = self.expert_layout or ExpertLayout()
        if self.moe_layers and not layout.expert_parallel:
            checks["moe_intermediate_size"] = self.moe_intermediate_size % tp_size == 0
        for name, ok in checks.items():
            if not ok:
                raise ValueError(
                    f"--tp {tp_size} does not split this model: {name} = {getattr(self, name)}"
                )
        if self.moe_layers:
            initial_expert_map(layout, self.num_experts, tp_size)  # raises naming the flag
        if self.quantization is not None and tp_size > 1:
            self._validate_blocks(tp_size)

    def _validate_blocks(self, tp_size: int) -> None:
        # each matrix split over ranks must split on block edges (its rows in q/k/v and
        # gate/up, its columns in o_proj and down_proj)
        rows, cols = self.quantization.block
        q_per_rank = self.num_attention_heads // tp_size * self.head_dim
        kv_per_rank = max(self.num_key_value_heads // tp_size, 1) * self.head_dim
        mlp_per_rank = self.intermediate_size // tp_size
        splits = {
            "num_attention_heads * head_dim": (q_per_rank, math.lcm(rows, cols)),
            "num_key_value_heads * head_dim": (kv_per_rank, rows),
            "intermediate_size": (mlp_per_rank, math.lcm(rows, cols)),
        }
        if not self.has_dense_mlp:
            del splits["intermediate_size"]
        layout = self.expert_layout or ExpertLayout()
        if self.moe_layers and not layout.expert_parallel:
            # each expert's gate/up rows and down columns split over the ranks
            moe_per_rank = self.moe_intermediate_size // tp_size
            splits["moe_intermediate_size"] = (moe_per_rank, math.lcm(rows, cols))
        for name, (per_rank, block) in splits.items():
            if per_rank % block:
                raise ValueError(
                    f"--tp {tp_size} does not split this model on fp8 blocks of "
                    f"{rows}x{cols}: {name} gives {per_rank} per rank, not a multiple of {block}"
                )

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Read a Hugging Face config.json dictionary (transformers 4.x or 5.x layout).

        Raises:
            ValueError: an unsupported architecture or option; the message names the field.
        """
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            fix = (
                "serve a checkpoint of one of these types with `weightbus serve`, or this one "
                "with vLLM and the weightbus plugin (docs/vllm.md)"
            )
            raise ValueError(
                with_fix(
                    f"config.json model_type {model_type!r} is not supported: {MODEL_TYPES}", fix
                )
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act {hf['hidden_act']!r} is not supported")
        if hf.get("mlp_bias", False):
            raise ValueError("config.json mlp_bias = true is not supported")
        if hf.get("use_sliding_window", False):
            raise ValueError("config.json use_sliding_window = true is not supported")
        num_heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        rope_theta, rope_scaling = _read_rope(hf)
        eos = hf.get("eos_token_id")
        moe = _read_moe(hf) if model_type == "qwen3_moe" else {}
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position_embeddings=hf["max_position_embeddings"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama's and Qwen3's
            # attention_bias sets both.
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_proj_bias=False if model_type == "qwen2" else attention_bias,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            quantization=_read_quantization(hf),
            qk_norm=model_type in QK_NORM_TYPES,
            **moe,
        )

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read `config.json` of a Hugging Face model directory.

        Raises:
            FileNotFoundError: no config.json in the directory.
            ValueError: see `from_hf_dict`.
        """
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_hf_dict(json.loads(path.read_text()))


def _read_moe(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes `num_local_experts` (`num_experts` is its alias), 4.x `num_experts`
    return {
        "num_experts": hf.get("num_experts", hf.get("num_local_experts")) or 0,
        "num_experts_per_tok": hf.get("num_experts_per_tok", 0),
        "moe_intermediate_size": hf.get("moe_intermediate_size", 0),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "decoder_sparse_step": hf.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(hf.get("mlp_only_layers") or ()),
    }


def _read_quantization(hf: dict[str, Any]) -> Fp8Block | None:
    quant = hf.get("quantization_config")
    return None if not quant else Fp8Block.from_hf_config(quant)


def _read_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x writes `rope_theta` and
    # `rope_scaling` (with "type" in old files).
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config.json partial_rotary_factor != 1 is not supported")
    if params.get("rope_type", "default") == "default":
        return rope_theta, None
    return rope_theta, params


def tiny_config() -> ModelConfig:
    """The built-in `tiny` model: a Llama of ~4M parameters that starts in seconds on 2 cores.

    Its vocabulary covers the byte-level fallback tokenizer: ids 0-255 are bytes, 256 is BOS,
    257 is EOS.
    """
    return ModelConfig(
        model_type="llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        bos_token_id=256,
        eos_token_ids=(257,),
    )
