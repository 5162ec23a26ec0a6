"""`ServedModels`: a main model and its draft as one set of weights (names, slice maps,
loading), and the `weightbus serve` flags that configure a draft."""

import re

import pytest
import torch
from engine_harness import HF_CASES, make_hf_model

from weightbus.core.meta import DRAFT_PREFIX
from weightbus.engines.reference.layers.parallel import TPContext, tp_context
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.llama import hf_weight_shapes
from weightbus.engines.reference.models.loader import create_model, random_hf_weights
from weightbus.engines.reference.models.served import ServedModels
from weightbus.engines.reference.server.launcher import (
    MAX_SPECULATIVE_TOKENS,
    ServeConfig,
    checked_model,
)


def _served(tp_size: int = 1, rank: int = 0, draft: bool = True) -> ServedModels:
    with tp_context(TPContext(tp_rank=rank, tp_size=tp_size)):
        main = create_model(tiny_config())
        return ServedModels(main, create_model(tiny_config()) if draft else None)


def test_the_draft_is_more_tensors_of_the_same_version():
    served = _served(tp_size=2, rank=1)
    shapes = hf_weight_shapes(tiny_config())
    expected = {**shapes, **{DRAFT_PREFIX + name: shape for name, shape in shapes.items()}}
    assert served.weight_shapes() == expected
    copies = served.shard_copies()
    assert [hf for hf, _, _ in copies] == list(expected)
    params = dict(served.named_parameters())
    assert all(param_name in params for _, param_name, _ in copies)
    assert {name for name, _, _ in copies if name.startswith(DRAFT_PREFIX)} == {
        DRAFT_PREFIX + name for name in shapes
    }


def test_load_weights_routes_each_name_to_its_model():
    served = _served()
    main = dict(random_hf_weights(tiny_config(), seed=1))
    draft = {DRAFT_PREFIX + n: t for n, t in random_hf_weights(tiny_config(), seed=2)}
    assert served.load_weights({**main, **draft}.items()) == set(main) | set(draft)
    assert torch.equal(served.main.model.norm.weight, main["model.norm.weight"])
    assert torch.equal(served.draft.model.norm.weight, draft["draft.model.norm.weight"])


def test_draft_names_without_a_draft_are_unknown():
    served = _served(draft=False)
    message = "unknown tensor 'draft.model.norm.weight': this engine serves no draft model"
    with pytest.raises(ValueError, match=re.escape(message)):
        served.load_weights([("draft.model.norm.weight", torch.ones(256))])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"draft_model": "tiny"}, "--draft-model and --num-speculative-tokens go together"),
        ({"num_speculative_tokens": 2}, "--draft-model and --num-speculative-tokens go together"),
        (
            {"draft_model": "tiny", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1},
            f"--num-speculative-tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got 17",
        ),
        (
            {"draft_model": "/nonexistent", "num_speculative_tokens": 2},
            "--draft-model must be 'tiny' or a directory with config.json: /nonexistent",
        ),
    ],
)
def test_draft_flags_are_checked(flags, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        ServeConfig(**flags)


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    make_hf_model(next(iter(HF_CASES)), tmp_path)  # vocab 101, the tiny model's is 512
    config = ServeConfig(draft_model=str(tmp_path), num_speculative_tokens=2)
    with pytest.raises(ValueError, match=r"--draft-model has vocab_size 101, the model 512"):
        checked_model(config)
