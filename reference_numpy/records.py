"""JSON records read from files: a checkpoint's training record and its loss scale, a tokenizer, an exported
artefact's manifest. Each is type-checked here before any of its fields is used, so that a damaged or hand-edited
record is one ``ValueError`` naming the record and the field (``training record field 'loss_scale' must be a JSON
object, got [32768.0, 0]``), the same in every backend: the ports read files through the reference's readers."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

Kind = type | tuple[type, ...]                 # what a field holds: a JSON type as Python parses it
NUMBER: Kind = (int, float)                    # a JSON number (true and false are not numbers)
_NAMES = {dict: "a JSON object", list: "a JSON array", str: "a string", int: "an integer", float: "a number",
          bool: "true or false"}


def parse_json(text: object, name: str, what: str = "JSON text") -> Any:
    """The JSON value of ``text``: a ``ValueError`` naming ``name`` if ``text`` is not a string or not JSON."""
    if not isinstance(text, str):
        raise ValueError(f"{name} must be {what}, got {type(text).__name__}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{name} is not {what} ({type(err).__name__}: {err})") from None


def record(value: object, name: str, fields: Mapping[str, Kind], optional: Collection[str] = (),
           others: bool = False, within: str = "") -> dict[str, Any]:
    """``value`` checked as record ``name`` (or its field ``within``, a dotted path): a JSON object holding each of
    ``fields`` as its kind (one of ``optional`` may be missing or null) and no other field unless ``others``.
    Returns it; anything else is one ``ValueError`` naming the record and the field."""
    where = f"{name} field {within!r}" if within else name
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {shown(value)}")
    for field, kind in fields.items():
        path = f"{within}.{field}" if within else field
        if value.get(field) is None and field in optional:
            continue
        if field not in value:
            raise ValueError(f"{name} field {path!r} is missing")
        check(value[field], kind, f"{name} field {path!r}")
    unknown = sorted(set(value) - set(fields))
    if unknown and not others:
        raise ValueError(f"{where} has an unknown field {unknown[0]!r}; expected {', '.join(fields)}")
    return value


def check(value: object, kind: Kind, where: str) -> Any:
    """``value`` if it is of ``kind`` (an int is not a bool, a number is not a bool); else a ``ValueError``
    saying ``where`` it is and what it should be."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ValueError(f"{where} must be {describe(kind)}, got {shown(value)}")
    return value


def describe(kind: Kind) -> str:
    """A kind in words: ``a JSON object``, ``a number``, ``a string or an integer``."""
    if kind == NUMBER:
        return "a number"
    return " or ".join(_NAMES.get(each, each.__name__) for each in (kind if isinstance(kind, tuple) else (kind,)))


def shown(value: object, width: int = 40) -> str:
    """``value`` as JSON text, cut to ``width`` characters: what a message shows of a bad field."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."
