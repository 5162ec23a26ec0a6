"""Hypothesis strategies for the plain values a msgspec type decodes from, derived from the type.

`values_for(SomeStruct)` draws mostly well-formed values (right shapes, fields in range, regex
patterns honoured, struct tags and array layouts as msgspec encodes them) and, at every level,
sometimes an arbitrary value instead (`chaos`): out-of-range numbers, wrong types, unknown or
missing fields. Encoded with msgpack or JSON, they reach a decoder's field checks, not only its
framing. A type added later gets its strategy without anyone writing one.
"""

from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st

KEYS = st.text(max_size=12)
SMALL_INTS = st.integers(-(2**63), 2**64 - 1)  # what msgpack carries


def chaos(json_only: bool = False) -> st.SearchStrategy[Any]:
    """Arbitrary values of a msgpack (or JSON) document, nested a few levels."""
    scalars = st.none() | st.booleans() | SMALL_INTS | st.floats() | st.text(max_size=20)
    if not json_only:
        scalars |= st.binary(max_size=20)
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
        max_leaves=12,
    )


def _int(info: mi.IntType) -> st.SearchStrategy[int]:
    low = info.ge if info.ge is not None else (info.gt + 1 if info.gt is not None else -(2**63))
    high = info.le if info.le is not None else (info.lt - 1 if info.lt is not None else 2**64 - 1)
    edges = st.sampled_from(sorted({low, max(low, min(high, low + 1)), high}))
    return edges | st.integers(low, min(high, low + 2**20)) | st.integers(low, high)


def _str(info: mi.StrType) -> st.SearchStrategy[str]:
    if info.pattern is not None:
        return st.from_regex(info.pattern)
    return st.text(min_size=info.min_length or 0, max_size=min(info.max_length or 24, 24))


def _sized(info: Any, low: int = 0, high: int = 3) -> dict[str, int]:
    return {
        "min_size": info.min_length or low,
        "max_size": max(info.min_length or low, min(info.max_length or high, high)),
    }


def _struct(info: mi.StructType, json_only: bool) -> st.SearchStrategy[Any]:
    fields = {
        field.encode_name: _with_chaos(field.type, json_only)
        for field in info.fields
        if field.required
    }
    optional = {
        field.encode_name: _with_chaos(field.type, json_only)
        for field in info.fields
        if not field.required
    }
    if info.array_like:
        # array form: required fields, then any prefix of the optional ones
        ordered = [_with_chaos(field.type, json_only) for field in info.fields]
        required = sum(field.required for field in info.fields)
        return st.integers(required, len(ordered)).flatmap(
            lambda count: st.tuples(*ordered[:count]).map(list)
        )
    mapping = st.fixed_dictionaries(fields, optional=optional)
    if info.tag_field is not None:
        mapping = mapping.map(lambda value: {info.tag_field: info.tag, **value})
    return mapping


def _collection(info: mi.Type, json_only: bool) -> st.SearchStrategy[Any] | None:
    match info:
        case mi.ListType() | mi.VarTupleType() | mi.SetType() | mi.FrozenSetType():
            return st.lists(_with_chaos(info.item_type, json_only), **_sized(info))
        case mi.TupleType():
            return st.tuples(*[_with_chaos(item, json_only) for item in info.item_types]).map(list)
        case mi.DictType():
            keys = _values(info.key_type, json_only)
            if json_only:  # JSON object keys are strings
                keys = keys.map(str)
            return st.dictionaries(keys, _with_chaos(info.value_type, json_only), **_sized(info))
    return None


def _values(info: mi.Type, json_only: bool) -> st.SearchStrategy[Any]:  # noqa: PLR0911
    match info:
        case mi.StructType():
            return _struct(info, json_only)
        case mi.IntType():
            return _int(info)
        case mi.StrType():
            return _str(info)
        case mi.BoolType():
            return st.booleans()
        case mi.NoneType():
            return st.none()
        case mi.FloatType():
            return st.floats(allow_nan=not json_only, allow_infinity=not json_only)
        case mi.LiteralType():
            return st.sampled_from(info.values)
        case mi.UnionType():
            return st.one_of([_values(member, json_only) for member in info.types])
        case mi.Metadata():
            return _values(info.type, json_only)
    collection = _collection(info, json_only)
    return chaos(json_only) if collection is None else collection


def _with_chaos(info: mi.Type, json_only: bool) -> st.SearchStrategy[Any]:
    # mostly well-formed (deep checks are reached); a wrong value anywhere must be named
    values = _values(info, json_only)
    return st.one_of(values, values, values, values, chaos(json_only))


def values_for(kind: Any, *, json_only: bool = False) -> st.SearchStrategy[Any]:
    """Plain values shaped like `kind` (a msgspec-decodable type), with wrong ones mixed in.

    Args:
        kind: a msgspec Struct class or any type msgspec can decode.
        json_only: draw only what JSON can carry (no bytes, no NaN).
    """
    return _values(mi.type_info(kind), json_only)


def msgpack_frames(kind: Any, prefix: list[Any] | None = None) -> st.SearchStrategy[bytes]:
    """msgpack encodings of `values_for(kind)`, each after the values in `prefix`, if any."""
    values = values_for(kind)
    if prefix is not None:
        values = values.map(lambda value: [*prefix, value])
    return values.map(msgspec.msgpack.encode)
