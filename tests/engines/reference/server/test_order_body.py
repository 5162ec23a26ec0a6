"""One update order: every message of a push that names its options is `UpdateOrder` itself
(rank 0's `UpdateWeights`, vLLM's `update_info`) or is generated from it (the HTTP body), so a
new option is one field in one struct."""

from typing import Annotated

import msgspec
import pytest
from pydantic import ValidationError

from weightbus.core.publisher import PushOrder
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.core.wire import UpdateOrder
from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.server.order_body import order_body_model
from weightbus.engines.reference.server.protocol import AdminRequest, UpdateWeightsRequest
from weightbus.engines.vllm.messages import VllmUpdateInfo

ORDER_FIELDS = UpdateOrder.__struct_fields__


def test_every_message_of_a_push_has_the_orders_fields_in_its_order():
    assert tuple(UpdateWeightsRequest.model_fields) == ORDER_FIELDS
    assert messages.UpdateWeights.__struct_fields__ == (*ORDER_FIELDS, "update_id")
    assert VllmUpdateInfo.__struct_fields__ == (*ORDER_FIELDS, "skip_unchanged")
    assert PushOrder.__struct_fields__ == (*ORDER_FIELDS, "probe", "carries_draft")


def test_an_engine_is_sent_the_order_and_not_what_only_the_publisher_knows():
    probe = LogprobProbe(token_ids=(1, 2), logprobs=(-0.5,), tolerance=0.1)
    order = PushOrder(
        version="v1", transport="disk", source={"path": "/x"}, probe=probe, carries_draft=True
    )
    sent = order.engine_fields()
    assert tuple(sent) == ORDER_FIELDS
    body = UpdateWeightsRequest.model_validate(sent)
    received = msgspec.convert(
        {**body.model_dump(), "update_id": "ab" * 16}, messages.UpdateWeights
    )
    assert received.engine_fields() == sent


class _OrderWithANewOption(UpdateOrder, frozen=True, kw_only=True):
    retries: Annotated[int, msgspec.Meta(ge=1, le=5, description="how often to retry")] = 3


def test_a_new_order_field_reaches_the_http_body_with_its_bounds():
    model = order_body_model(_OrderWithANewOption, name="Body", base=AdminRequest)
    schema = model.model_json_schema()["properties"]["retries"]
    assert (schema["minimum"], schema["maximum"], schema["default"]) == (1, 5, 3)
    assert schema["description"] == "how often to retry"
    fields = {"version": "v1", "transport": "disk", "source": {}}
    assert model.model_validate({**fields, "retries": 2}).retries == 2
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        model.model_validate({**fields, "retries": 0})
