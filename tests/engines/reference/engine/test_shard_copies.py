"""The slice map (`shard_copies`) is exactly what `load_weights` does, on every rank."""

import pytest
import torch

from weightbus.engines.reference.layers.parallel import TPContext, tp_context
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import create_model, random_hf_weights


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("num_kv_heads", [4, 1], ids=["kv4", "kv1-replicated"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_applying_the_slice_map_equals_load_weights(tp_size, num_kv_heads, tied):
    config = tiny_config()
    config.num_key_value_heads = num_kv_heads
    config.tie_word_embeddings = tied
    config.__post_init__()
    full = dict(random_hf_weights(config, seed=3))
    for rank in range(tp_size):
        with tp_context(TPContext(tp_rank=rank, tp_size=tp_size)):
            loaded = create_model(config)
            mapped = create_model(config)
        for param in [*loaded.parameters(), *mapped.parameters()]:
            param.data.zero_()
        loaded.load_weights(full.items())
        params = dict(mapped.named_parameters())
        copies = mapped.shard_copies()
        assert sorted(name for name, _, _ in copies) == sorted(full)
        for hf_name, param_name, copy in copies:
            copy.apply(params[param_name].data, full[hf_name])
        for (name, want), (_, got) in zip(
            loaded.named_parameters(), mapped.named_parameters(), strict=True
        ):
            assert torch.equal(got, want), (rank, name)


def test_a_wrong_full_shape_is_named():
    with tp_context(TPContext(tp_rank=0, tp_size=2)):
        model = create_model(tiny_config())
    layer = model.model.layers[0].self_attn.qkv_proj
    with pytest.raises(ValueError, match=r"shape mismatch: expected \(128, 256\), got \(64, 256\)"):
        layer.shard_copy(layer.weight, (64, 256), "k")
    with pytest.raises(ValueError, match="unknown qkv shard id 'x'"):
        layer.shard_copy(layer.weight, (128, 256), "x")
