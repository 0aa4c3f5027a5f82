"""Where a decoded JSON value does not fit a msgspec type, found from the
type's structure (``msgspec.inspect``), never from msgspec's error text.
Plain functions, no I/O.

A request is decoded by msgspec; only when msgspec refuses it is its plain
JSON value walked against the type, to name the offending field with its
path (``messages[0].role``, ``stop[1]``; a dict's value is ``logit_bias[...]``).
The walk meets problems in msgspec's order: an object's keys as they come
(an unknown one, or one whose value does not fit), then its missing required
fields in declaration order; so it names the field msgspec stopped at.

``unknown_fields`` lists the fields a value has that its type does not
know (at any depth), for a server that ignores them but says so.

It knows the types request structs are made of: structs (tagged or not),
lists, dicts with string keys, unions of these, ``Literal``, ``Any``, and
``int``, ``float``, ``str``, ``bool``, ``None``. Anything else (a
constraint such as ``Meta(ge=0)``, a ``datetime``) it takes as fitting: a
caller that finds no misfit must still answer, without a field.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec.inspect as mi

from trioserve.checks import short_repr

MAX_FIELD_NAME = 64  # an unknown field's name is echoed at most this long

# The JSON names of the types a value may have, in the order a union lists them.
_KINDS = ("bool", "int", "float", "str", "object", "array", "null")
_KIND_OF: dict[type, str] = {
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    dict: "object",
    list: "array",
    type(None): "null",
}


@dataclass(frozen=True)
class Misfit:
    """The first part of a value that does not fit its type."""

    path: str  # "" for the value itself
    kind: Literal["unknown_field", "missing_field", "invalid_type"]
    message: str  # lower-case, without the path: "expected `int | null`, got `str`"


def find_misfit(value: object, target: Any) -> Misfit | None:
    """The first misfit of ``value`` (decoded JSON: dicts, lists, str, int,
    float, bool, None) with the type ``target``; None when none is found."""
    return _walk(value, _info(target), "")


@functools.cache
def _info(target: Any) -> mi.Type:
    return mi.type_info(target)


def _walk(value: object, info: mi.Type, path: str) -> Misfit | None:
    if isinstance(info, mi.UnionType):
        return _walk_union(value, info, path)
    if not _takes(info, _kind(value)):
        return _wrong_type(value, info, path)
    if isinstance(info, mi.LiteralType) and not any(type(v) is type(value) and v == value for v in info.values):
        return Misfit(path, "invalid_type", f"invalid enum value {short_repr(value)}")
    if isinstance(info, mi.StructType) and isinstance(value, dict):
        return _walk_struct(value, info, path)
    if isinstance(info, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType) and isinstance(value, list):
        return _first(_walk(item, info.item_type, f"{path}[{i}]") for i, item in enumerate(value))
    if isinstance(info, mi.DictType) and isinstance(value, dict):
        if isinstance(info.key_type, mi.IntType):  # JSON writes such keys as strings: {"42": ...}
            bad_key = next((k for k in value if not re.fullmatch(r"-?(0|[1-9][0-9]*)", k)), None)
            if bad_key is not None:
                return Misfit(
                    path, "invalid_type", f"keys must be integers written as strings (got {short_repr(bad_key)})"
                )
        return _first(_walk(item, info.value_type, f"{path}[...]") for item in value.values())
    return None


def _walk_union(value: object, info: mi.UnionType, path: str) -> Misfit | None:
    """The member that takes values of this JSON type decides; msgspec allows
    several only for tagged structs, chosen by their tag."""
    members: list[mi.Type] = [member for member in info.types if _takes(member, _kind(value))]
    if not members:
        return _wrong_type(value, info, path)
    if len(members) > 1 and isinstance(value, dict):
        tagged = [m for m in members if isinstance(m, mi.StructType) and m.tag_field is not None]
        tag_field = tagged[0].tag_field if tagged else None
        if tag_field is not None and tag_field not in value:
            return Misfit(_join(path, tag_field), "missing_field", "missing")
        chosen = [m for m in tagged if m.tag_field is not None and value.get(m.tag_field) == m.tag]
        if not chosen:
            return Misfit(_join(path, str(tag_field)), "invalid_type", f"invalid value {short_repr(value[tag_field])}")
        return _walk(value, chosen[0], path)
    return _walk(value, members[0], path)


def _walk_struct(value: dict[Any, Any], info: mi.StructType, path: str) -> Misfit | None:
    fields = {field.encode_name: field for field in info.fields}
    for name, item in value.items():
        if name == info.tag_field:
            if not isinstance(item, str):
                return Misfit(_join(path, name), "invalid_type", f"expected `str`, got `{_kind(item)}`")
            if item != info.tag:
                return Misfit(_join(path, name), "invalid_type", f"invalid value {short_repr(item)}")
        elif name in fields:
            if (found := _walk(item, fields[name].type, _join(path, name))) is not None:
                return found
        elif info.forbid_unknown_fields:
            return Misfit(_join(path, str(name)[:MAX_FIELD_NAME]), "unknown_field", "unknown field")
    for field in info.fields:
        if field.required and field.encode_name not in value:
            return Misfit(_join(path, field.encode_name), "missing_field", "missing")
    return None


MAX_UNKNOWN_FIELDS = 16  # listed at most, per value


def unknown_fields(value: object, target: Any) -> list[str]:
    """The paths of the fields of ``value`` (decoded JSON that fits
    ``target``) that ``target``'s structs do not have, in the order met (at
    most ``MAX_UNKNOWN_FIELDS``). Lists of scalars are not walked."""
    found: list[str] = []
    _collect(value, _info(target), "", found)
    return found


def _collect(value: object, info: mi.Type, path: str, found: list[str]) -> None:
    if len(found) >= MAX_UNKNOWN_FIELDS or not _has_struct(info):
        return
    if isinstance(info, mi.UnionType):
        members = [member for member in info.types if _takes(member, _kind(value))]
        if len(members) > 1 and isinstance(value, dict):
            members = [
                m for m in members if isinstance(m, mi.StructType) and value.get(m.tag_field or "") == m.tag
            ] or members[:1]
        if members:
            _collect(value, members[0], path, found)
    elif isinstance(info, mi.StructType) and isinstance(value, dict):
        fields = {field.encode_name: field for field in info.fields}
        for name, item in value.items():
            if name in fields:
                _collect(item, fields[name].type, _join(path, name), found)
            elif name != info.tag_field and len(found) < MAX_UNKNOWN_FIELDS:
                found.append(_join(path, str(name)[:MAX_FIELD_NAME]))
    elif isinstance(info, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType) and isinstance(value, list):
        for i, item in enumerate(value):
            _collect(item, info.item_type, f"{path}[{i}]", found)
    elif isinstance(info, mi.DictType) and isinstance(value, dict):
        for item in value.values():
            _collect(item, info.value_type, f"{path}[...]", found)


_HAS_STRUCT: dict[int, bool] = {}  # by id: the infos are those _info keeps (mi types are not hashable)


def _has_struct(info: mi.Type) -> bool:
    """Whether a value of ``info`` may hold a struct (the only place an unknown field can be)."""
    if (known := _HAS_STRUCT.get(id(info))) is not None:
        return known
    if isinstance(info, mi.StructType):
        has = True
    elif isinstance(info, mi.UnionType):
        has = any(_has_struct(member) for member in info.types)
    elif isinstance(info, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
        has = _has_struct(info.item_type)
    elif isinstance(info, mi.DictType):
        has = _has_struct(info.value_type)
    else:
        has = False
    _HAS_STRUCT[id(info)] = has
    return has


def _wrong_type(value: object, info: mi.Type, path: str) -> Misfit:
    return Misfit(path, "invalid_type", f"expected `{' | '.join(_names(info))}`, got `{_kind(value)}`")


def _kind(value: object) -> str:
    return _KIND_OF.get(type(value), type(value).__name__)


def _takes(info: mi.Type, kind: str) -> bool:
    """Whether ``info`` takes some values of the JSON type ``kind``."""
    if isinstance(info, mi.AnyType):
        return True
    if isinstance(info, mi.UnionType):
        return any(_takes(member, kind) for member in info.types)
    names = _names(info)
    return kind in names or (kind == "int" and "float" in names) or not set(names) <= set(_KINDS)


def _names(info: mi.Type) -> list[str]:
    """The JSON types ``info`` takes (in a union's order); a type this walk
    does not know is named by its class (and taken as fitting)."""
    if isinstance(info, mi.UnionType):
        names = {name for member in info.types for name in _names(member)}
        return sorted(names, key=lambda name: _KINDS.index(name) if name in _KINDS else -1)
    if isinstance(info, mi.LiteralType):
        return sorted({_kind(v) for v in info.values}, key=_KINDS.index)
    if isinstance(info, mi.StructType):
        return ["array" if info.array_like else "object"]
    simple: dict[type[mi.Type], str] = {
        mi.BoolType: "bool",
        mi.IntType: "int",
        mi.FloatType: "float",
        mi.StrType: "str",
        mi.DictType: "object",
        mi.ListType: "array",
        mi.SetType: "array",
        mi.FrozenSetType: "array",
        mi.VarTupleType: "array",
        mi.TupleType: "array",
        mi.NoneType: "null",
    }
    return [simple.get(type(info), type(info).__name__)]


def _first(misfits: Any) -> Misfit | None:
    return next((found for found in misfits if found is not None), None)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
