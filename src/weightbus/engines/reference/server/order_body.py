"""The body of `POST /v1/update_weights`, generated from the one update order.

`UpdateOrder` (`weightbus.core.wire.order`) declares every field of a push once, with its type,
bounds and default. The HTTP edge validates with pydantic (FastAPI's schema and 422 answers),
so the model is derived from the struct here, field by field, rather than declared a second
time: a new order field reaches the API and its OpenAPI schema with no edit of the server.
"""

import types
import typing
from typing import Annotated, Any, Union, get_args, get_origin

import msgspec
from pydantic import BaseModel, Field, create_model, field_validator

# msgspec.Meta constraints pydantic's Field takes under the same name
_CONSTRAINTS = ("gt", "ge", "lt", "le", "min_length", "max_length", "pattern", "description")


def _field_info(meta: msgspec.Meta, inner: Any) -> Any:
    kwargs = {name: getattr(meta, name) for name in _CONSTRAINTS}
    kwargs = {name: value for name, value in kwargs.items() if value is not None}
    if inner is float:
        kwargs["allow_inf_nan"] = False  # JSON has no NaN: a bound must be a number
    return Field(**kwargs)


def pydantic_type(hint: Any) -> Any:
    """The pydantic annotation of a msgspec field type: `msgspec.Meta` bounds become `Field`
    bounds, nested structs plain JSON objects (validated by msgspec, see `order_body_model`)."""
    origin = get_origin(hint)
    if origin is Annotated:
        inner, *extras = get_args(hint)
        fields = [_field_info(m, inner) for m in extras if isinstance(m, msgspec.Meta)]
        return Annotated[(pydantic_type(inner), *fields)] if fields else pydantic_type(inner)
    if origin in (Union, types.UnionType):
        return Union[tuple(pydantic_type(arg) for arg in get_args(hint))]  # noqa: UP007 - built from a tuple
    if origin is list:
        (item,) = get_args(hint)
        return list[pydantic_type(item)]
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return dict[str, Any]
    return hint


def _struct_fields(hint: Any) -> type[msgspec.Struct] | None:
    """The msgspec struct a field holds (alone or with None), if any."""
    for arg in (hint, *get_args(hint)):
        if isinstance(arg, type) and issubclass(arg, msgspec.Struct):
            return arg
    return None


def _struct_validator(name: str, struct: type[msgspec.Struct]) -> Any:
    def check(cls: type, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                msgspec.convert(value, struct)
            except msgspec.ValidationError as exc:
                raise ValueError(f"{name}: {exc}") from None
        return value

    return field_validator(name)(classmethod(check))


def order_body_model(
    struct: type[msgspec.Struct], *, name: str, base: type[BaseModel]
) -> type[BaseModel]:
    """A pydantic model with `struct`'s fields, in their order, with their bounds and
    defaults, on top of `base`.

    Args:
        struct: the msgspec struct that declares the fields.
        name: the model's name.
        base: the model's base (its config: unknown fields, strictness).

    Returns:
        The model class; a nested struct's field is a JSON object checked by msgspec (a 422
        naming the field and what is wrong in it).
    """
    hints = typing.get_type_hints(struct, include_extras=True)
    fields: dict[str, Any] = {}
    validators: dict[str, Any] = {}
    for field in msgspec.structs.fields(struct):
        if field.default_factory is not msgspec.NODEFAULT:
            default = Field(default_factory=field.default_factory)
        else:
            default = ... if field.required else field.default
        fields[field.name] = (pydantic_type(hints[field.name]), default)
        nested = _struct_fields(hints[field.name])
        if nested is not None:
            validators[f"_check_{field.name}"] = _struct_validator(field.name, nested)
    return create_model(name, __base__=base, __validators__=validators, **fields)
