"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Qwen3-MoE) built from tensor-parallel layers.

Module and parameter names mirror Hugging Face's, except the fused `qkv_proj` and
`gate_up_proj`, and the experts of MoE layers, held fused in `mlp.experts.w13_weight` and
`mlp.experts.w2_weight` (`layers/moe.py`); `LlamaForCausalLM.load_weights` maps Hugging Face
names (per-expert `mlp.experts.E.{gate,up,down}_proj.weight`) onto them.
"""

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from weightbus.core.fp8 import FP8_DTYPE, SCALE_SUFFIX, quantizes
from weightbus.core.meta import dtype_from_name
from weightbus.core.plan.shard import ShardCopy
from weightbus.core.wire.adapter import adapter_names, hf_module
from weightbus.engines.reference.layers.activation import SiluAndMul
from weightbus.engines.reference.layers.attention import Attention, AttentionMetadata
from weightbus.engines.reference.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from weightbus.engines.reference.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from weightbus.engines.reference.layers.lora import LoraPart, LoraState
from weightbus.engines.reference.layers.moe import (
    EXPERT_NAME,
    EXPERT_PROJECTIONS,
    FusedMoE,
    SlotRoute,
    SparseMoeBlock,
)
from weightbus.engines.reference.layers.norm import RMSNorm
from weightbus.engines.reference.layers.parallel import get_tp
from weightbus.engines.reference.layers.rotary import RotaryEmbedding
from weightbus.engines.reference.models.config import ModelConfig
from weightbus.engines.reference.models.experts import (
    ExpertLayout,
    ExpertMap,
    initial_expert_map,
    slot_transfers,
)


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and full (unsharded) shapes of the Hugging Face tensors this model loads, in order.

    With tied embeddings `lm_head.weight` is absent: the head reuses `model.embed_tokens.weight`.
    Block-FP8 models hold each quantized matrix's `_scale_inv` right after it.
    """
    quant = config.quantization
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in dense_weight_shapes(config).items():
        shapes[name] = shape
        if quant is not None and quantizes(name, shape):
            shapes[name + SCALE_SUFFIX] = quant.scale_shape(shape)
    return shapes


def hf_weight_dtypes(config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype each tensor of `hf_weight_shapes` is served in: `dtype`, but float8_e4m3fn
    and float32 for block-FP8 matrices and their scales."""
    if config.quantization is None:
        return dict.fromkeys(hf_weight_shapes(config), dtype)
    dtypes = {}
    for name, shape in dense_weight_shapes(config).items():
        quantized = quantizes(name, shape)
        dtypes[name] = FP8_DTYPE if quantized else dtype
        if quantized:
            dtypes[name + SCALE_SUFFIX] = torch.float32
    return dtypes


def dense_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """`hf_weight_shapes` without block-FP8 scales: the tensors a trainer holds (an MoE
    layer's as Hugging Face checkpoints hold them: the router, then each expert's three)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size = config.num_attention_heads * head_dim
    kv_size = config.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    moe_layers = config.moe_layers
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        for proj, size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            shapes[f"{prefix}.self_attn.{proj}.weight"] = (size, hidden)
            if config.qkv_bias:
                shapes[f"{prefix}.self_attn.{proj}.bias"] = (size,)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, q_size)
        if config.o_proj_bias:
            shapes[f"{prefix}.self_attn.o_proj.bias"] = (hidden,)
        if config.qk_norm:
            shapes[f"{prefix}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{prefix}.self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        if i in moe_layers:
            shapes |= _moe_weight_shapes(config, f"{prefix}.mlp")
            continue
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (config.intermediate_size, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (config.intermediate_size, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, config.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def _moe_weight_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    hidden, size = config.hidden_size, config.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.gate.weight": (config.num_experts, hidden)}
    for expert in range(config.num_experts):
        for projection in EXPERT_PROJECTIONS:
            full = (hidden, size) if projection == "down_proj" else (size, hidden)
            shapes[f"{prefix}.experts.{expert}.{projection}.weight"] = full
    return shapes


def adapter_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names (peft's) and full shapes of the adapter tensors an adapter push carries, in
    order: each layer's targeted projections, A `(r, in)` then B `(out, r)` (empty without
    `config.lora`)."""
    if config.lora is None:
        return {}
    rank, dense = config.lora.rank, dense_weight_shapes(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(config.num_hidden_layers):
        for projection in config.lora.targets:
            a_name, b_name = adapter_names(i, projection)
            out_features, in_features = dense[f"{hf_module(i, projection)}.weight"]
            shapes[a_name], shapes[b_name] = (rank, in_features), (out_features, rank)
    return shapes


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.qkv_bias,
            quant=config.quantization,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            bias=config.o_proj_bias,
            quant=config.quantization,
        )
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        # Qwen3: each head of q and k normalised before rope (replicated, per head_dim)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attn = Attention(
            self.num_heads, self.head_dim, self.num_kv_heads, scale=config.head_dim**-0.5
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        quant = config.quantization
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, quant=quant
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, quant=quant
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def _moe_block(config: ModelConfig, routes: tuple[SlotRoute, ...]) -> SparseMoeBlock:
    layout = config.expert_layout or ExpertLayout()
    return SparseMoeBlock(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        norm_topk_prob=config.norm_topk_prob,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        routes=routes,
        expert_parallel=layout.expert_parallel,
        quant=config.quantization,
    )


class LlamaDecoderLayer(nn.Module):
    """Attention, then a dense MLP, or an MoE block holding `routes`' slots."""

    def __init__(self, config: ModelConfig, routes: tuple[SlotRoute, ...] | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config) if routes is None else _moe_block(config, routes)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # attention block, then MLP block, each with a residual (transformers' op order)
        residual = hidden_states
        hidden_states = self.self_attn(positions, self.input_layernorm(hidden_states), meta)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, routes: tuple[SlotRoute, ...] | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        moe_layers = config.moe_layers
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, routes if i in moe_layers else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, meta)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    """Llama/Qwen2/Qwen3/Qwen3-MoE causal LM, sharded over the current tensor-parallel context.

    Build it inside `weightbus.engines.reference.layers.parallel.tp_context` (or after
    `init_tp_group`) to get the
    shards of a given rank. Parameters are created uninitialized: load weights before use.

    Args:
        config: architecture, and `config.expert_layout` for an MoE model.
        expert_map: where the experts start (None: `initial_expert_map` of the layout); for
            a model built to mirror another one, its `expert_map`.

    Raises:
        ValueError: an expert map for a model without experts, or one that does not fit the
            layout (its expert-parallel ranks, its experts).
    """

    # HF projection -> (fused parameter, shard id passed to its weight_loader)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, expert_map: ExpertMap | None = None) -> None:
        super().__init__()
        self.config = config
        layout = config.expert_layout or ExpertLayout()
        tp = get_tp()
        # this rank's row of the expert map (every TP rank is expert-parallel rank 0 without EP)
        self._ep_rank = tp.tp_rank if layout.expert_parallel else 0
        self._expert_map = _first_expert_map(config, layout, tp.tp_size, expert_map)
        routes = None if self._expert_map is None else self._expert_map.routes(self._ep_rank)
        self.model = LlamaModel(config, routes)
        # MoE layer's experts module name -> the module (what per-expert names load into)
        self._experts = {
            name: module for name, module in self.named_modules() if isinstance(module, FusedMoE)
        }
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.lora_state = LoraState()  # the adapter applies while active (`set_adapter_state`)
        self._adapters = self._attach_adapters()

    def _attach_adapters(self) -> dict[str, tuple[str, LoraPart]]:
        """Give every targeted projection its adapter; returns pushed name -> (parameter
        name, part) for A and B of each."""
        lora = self.config.lora
        if lora is None:
            return {}
        modules = dict(self.named_modules())
        dtype = dtype_from_name(lora.dtype)
        adapters: dict[str, tuple[str, LoraPart]] = {}
        for i in range(self.config.num_hidden_layers):
            for projection in lora.targets:
                param_name, shard_id = self._param_name(f"{hf_module(i, projection)}.weight")
                layer_name = param_name.removesuffix(".weight")
                layer = modules[layer_name]
                assert isinstance(layer, LinearBase)
                layer.attach_lora(projection, shard_id, lora.rank, dtype, self.lora_state)
                part = layer.lora[projection]
                prefix = f"{layer_name}.lora.{projection}"
                a_name, b_name = adapter_names(i, projection)
                adapters[a_name] = (f"{prefix}.lora_A", part)
                adapters[b_name] = (f"{prefix}.lora_B", part)
        return adapters

    @property
    def expert_map(self) -> ExpertMap | None:
        """The live expert map of every MoE layer (None: no experts)."""
        return self._expert_map

    def place_experts(self, new_map: ExpertMap) -> None:
        """Move the experts to `new_map`, then route by it: every slot whose expert changes
        takes that expert's weights from a rank that holds it under the current map (its own
        when it does), over the TP group. A collective: every rank calls it with the same map.
        (`models.experts.place_experts` moves several models alike.)

        Raises:
            ValueError: a model without experts, or a map of other experts, ranks or slots
                per rank (nothing moves).
        """
        if self._expert_map is None:
            raise ValueError("this model has no experts to place")
        transfers = slot_transfers(self._expert_map, new_map)
        routes = new_map.routes(self._ep_rank)
        for experts in self._experts.values():
            experts.move(transfers, routes)
        self._expert_map = new_map

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states `[num_tokens, hidden_size]` of a packed batch (see AttentionMetadata)."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits `[n, vocab_size]` on every rank."""
        return self.lm_head(hidden_states)

    def expected_weight_names(self) -> list[str]:
        """Hugging Face names that a complete `load_weights` must receive, in checkpoint order."""
        return list(hf_weight_shapes(self.config))

    def shard_copies(self) -> list[tuple[str, str, ShardCopy]]:
        """This rank's slice map: `(hf_name, parameter name, ShardCopy)` for every HF tensor
        this rank takes bytes of (each at most once).

        It is what `load_weights` does, as data: applying each copy from the full HF tensors
        fills this rank's parameters exactly as `load_weights` would (padding rows aside, which
        stay as allocated). An expert's tensor has an entry only on the ranks holding the
        expert (`dst_slot`: its slot in the fused parameter).
        """
        params = dict(self.named_parameters())
        copies = []
        for hf_name, full_shape in hf_weight_shapes(self.config).items():
            if (expert := self._expert_target(hf_name)) is not None:
                module_name, experts, index, projection, scale = expert
                param_attr, copy = experts.expert_copy(full_shape, index, projection, scale=scale)
                if copy is not None:
                    copies.append((hf_name, f"{module_name}.{param_attr}", copy))
                continue
            param_name, shard_id = self._param_name(hf_name)
            param = params[param_name]
            layer = param.weight_loader.__self__
            copies.append((hf_name, param_name, layer.shard_copy(param, full_shape, shard_id)))
        return copies

    def adapter_shard_copies(self) -> list[tuple[str, str, ShardCopy]]:
        """This rank's slice map of the adapter tensors (`shard_copies`' form)."""
        params = dict(self.named_parameters())
        shapes = adapter_weight_shapes(self.config)
        return [
            (pushed, param_name, part.shard_copy(params[param_name], shapes[pushed]))
            for pushed, (param_name, part) in self._adapters.items()
        ]

    def load_adapter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy pushed adapter tensors (peft's names, any subset) into this rank's slices.

        Raises:
            ValueError: an unknown name (a projection this engine does not adapt) or a wrong
                shape; the message names the tensor.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in self._adapters:
                    raise ValueError(
                        f"unknown tensor {name!r}: this engine adapts "
                        f"{self.config.lora.describe() if self.config.lora else 'nothing'}"
                    )
                param_name, part = self._adapters[name]
                try:
                    part.weight_loader(params[param_name], tensor)
                except ValueError as exc:
                    raise ValueError(f"tensor {name!r}: {exc}") from None
                loaded.add(name)
        return loaded

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face tensors into this rank's (fused, sharded) parameters, in place.

        May be called repeatedly, each time with any subset of the tensors. The tensors are
        only read (they may be views into a reused buffer); no reference is kept.

        Args:
            weights: `(hf_name, full_tensor)` pairs; dtypes are converted to the parameter's.

        Returns:
            The Hugging Face names loaded. Tensors the model does not use (rotary `inv_freq`
            buffers, and `lm_head.weight` when embeddings are tied) are skipped, not returned.
            An expert's tensor goes into every local slot holding the expert; one of an
            expert this rank does not hold is checked, skipped and returned (as vLLM does
            under expert parallelism), so completeness checks hold on every rank.

        Raises:
            ValueError: an unknown name or a wrong shape; the message names the tensor.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name.endswith("rotary_emb.inv_freq") or (
                    name == "lm_head.weight" and self.config.tie_word_embeddings
                ):
                    continue
                if (expert := self._expert_target(name)) is not None:
                    _, experts, index, projection, scale = expert
                    try:
                        experts.load_expert(tensor, index, projection, scale=scale)
                    except ValueError as exc:
                        raise ValueError(f"tensor {name!r}: {exc}") from None
                    loaded.add(name)
                    continue
                param_name, shard_id = self._param_name(name)
                param = params.get(param_name)
                if param is None:
                    raise ValueError(f"unknown tensor {name!r}: this model has no such weight")
                try:
                    if shard_id is None:
                        param.weight_loader(param, tensor)
                    else:
                        param.weight_loader(param, tensor, shard_id)
                except ValueError as exc:
                    raise ValueError(f"tensor {name!r}: {exc}") from None
                loaded.add(name)
        return loaded

    def _expert_target(self, hf_name: str) -> tuple[str, FusedMoE, int, str, bool] | None:
        """`(module name, module, expert, projection, is a scale)` of a per-expert Hugging
        Face name (None: not an expert's tensor)."""
        match = EXPERT_NAME.match(hf_name)
        if match is None or match.group(1) not in self._experts:
            return None
        module_name, expert, projection, tensor = match.groups()
        scale = tensor == "weight_scale_inv"
        return module_name, self._experts[module_name], int(expert), projection, scale

    def _param_name(self, hf_name: str) -> tuple[str, str | int | None]:
        parts = hf_name.split(".")
        for i, part in enumerate(parts):
            if part in self.packed_modules_mapping:
                fused, shard_id = self.packed_modules_mapping[part]
                return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard_id
        return hf_name, None


def _first_expert_map(
    config: ModelConfig, layout: ExpertLayout, tp_size: int, expert_map: ExpertMap | None
) -> ExpertMap | None:
    """The map a model starts with: `expert_map`, checked, or the layout's initial one."""
    if not config.moe_layers:
        if expert_map is not None:
            raise ValueError("expert_map given for a model without experts")
        return None
    if expert_map is None:
        return initial_expert_map(layout, config.num_experts, tp_size)
    ep_size = layout.ep_size(tp_size)
    if (expert_map.num_experts, expert_map.ep_size) != (config.num_experts, ep_size):
        raise ValueError(
            f"expert map: {expert_map.num_experts} experts on {expert_map.ep_size} ranks, the "
            f"model has {config.num_experts} experts on {ep_size} expert-parallel ranks"
        )
    return expert_map
