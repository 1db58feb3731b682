"""What the host shows of the files a run's containers write: typed, and printable.

``status.json``, ``summary.json`` (and, until the launcher's own records move out of the run directory,
``run.json`` and ``spec.json``) are written where the run's code can rewrite them, so a value may have any
JSON type and a string any character: ``"outcome": "\\u001b]52;c;...\\u0007"`` (an OSC-52 escape that sets
the terminal's clipboard) or ``"mean_return": "x"``. Everything :mod:`launcher.lifecycle`,
:mod:`launcher.history`, the supervisor and the progress reporters read there passes through here first:

* :func:`status_doc` and :func:`summary_doc` keep a field only when it has the type the published schema
  (``launcher/schemas``) gives it, so code that formats ``mean_return`` with ``:.2f`` meets a number or
  None, never a string;
* every string (keys included) comes out with its control characters escaped (:func:`printable`), so it
  prints as ``\\x1b]52;...`` rather than acting on the terminal.

Pure functions; nothing here reads a file.
"""

from __future__ import annotations

import math
import re
from functools import cache
from typing import Any

from launcher import schemas

MAX_TEXT = 400  # characters of one string shown; the rest becomes "..."
MAX_DEPTH = 8  # nesting kept of a value the schema does not describe
_DROP = object()


def printable(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` with every character that is not printable (C0/C1 controls, DEL, line and paragraph
    separators, ...) written as its Python escape (``\\x1b``, ``\\n``, ``\\u2028``), cut to ``limit``
    characters."""
    cut = text[:limit]
    out = cut if cut.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return out + ("..." if len(text) > limit else "")


def text(value: Any, limit: int = MAX_TEXT) -> str | None:
    """A string value made printable, else None (a number where a name was expected is not shown)."""
    return printable(value, limit) if isinstance(value, str) else None


def number(value: Any) -> float | int | None:
    """An int or a finite float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if isinstance(value, int) or math.isfinite(value) else None


def integer(value: Any) -> int | None:
    """An int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _has_type(value: Any, kind: str) -> bool:
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return integer(value) is not None
    if kind == "number":
        return number(value) is not None
    if kind == "string":
        return isinstance(value, str)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    return False


def _plain(value: Any, depth: int) -> Any:
    """A value no schema describes: strings made printable, containers walked (to ``MAX_DEPTH``)."""
    if isinstance(value, str):
        return printable(value)
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if depth >= MAX_DEPTH:
        return _DROP
    if isinstance(value, dict):
        return {printable(str(k)): v for k, v in ((k, _plain(v, depth + 1)) for k, v in value.items())
                if v is not _DROP}
    if isinstance(value, list):
        return [v for v in (_plain(x, depth + 1) for x in value) if v is not _DROP]
    return _DROP


def conform(value: Any, schema: dict[str, Any] | None, depth: int = 0) -> Any:
    """``value`` as ``schema`` (a JSON Schema subset: type, enum, const, properties, additionalProperties,
    propertyNames' pattern, items) allows it, or ``_DROP``: a property of the wrong type is left out, one the
    schema does not describe is kept as :func:`_plain` makes it."""
    if schema is None:
        return _plain(value, depth)
    kinds = schema.get("type")
    if kinds is not None and not any(_has_type(value, k) for k in ([kinds] if isinstance(kinds, str) else kinds)):
        return _DROP
    if ("enum" in schema and value not in schema["enum"]) or ("const" in schema and value != schema["const"]):
        return _DROP
    if depth >= MAX_DEPTH and isinstance(value, (dict, list)):
        return _DROP
    if isinstance(value, dict):
        props: dict[str, Any] = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        pattern = (schema.get("propertyNames") or {}).get("pattern")
        out: dict[str, Any] = {}
        for key, item in value.items():
            if pattern is not None and not re.search(pattern, key):
                continue
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            kept = conform(item, sub, depth + 1)
            if kept is not _DROP:
                out[printable(key)] = kept
        return out
    if isinstance(value, list):
        items = schema.get("items")
        return [v for v in (conform(x, items if isinstance(items, dict) else None, depth + 1) for x in value)
                if v is not _DROP]
    return _plain(value, depth)


# C0 controls but newline, tab, carriage return and backspace (progress bars use the last two), DEL, and the
# C1 controls as UTF-8 (U+0080-U+009F: a terminal may take U+009B as CSI and U+009D as OSC).
_TERMINAL_UNSAFE = re.compile(rb"[\x00-\x07\x0b\x0c\x0e-\x1a\x1c-\x1f\x7f]|\x1b|\xc2[\x80-\x9f]")


def terminal_safe(data: bytes) -> bytes:
    """Log bytes as a terminal may show them: every control sequence introducer (ESC, C1) and other control
    byte written as ``\\xNN`` text, so a run's output cannot set the clipboard (OSC 52), retitle or redraw
    the terminal; newlines, tabs, carriage returns and backspaces pass."""
    return _TERMINAL_UNSAFE.sub(lambda m: b"".join(b"\\x%02x" % b for b in m.group(0)), data)


@cache
def _summary_schema() -> dict[str, Any]:
    schema: dict[str, Any] = schemas.load(schemas.RESULT_SCHEMA)["properties"]["summary"]
    return schema


def status_doc(doc: Any) -> dict[str, Any]:
    """The master's ``status.json`` (schema ``launcher.status/v1``) with every field of the wrong type left
    out and every string printable; ``{}`` for anything but an object."""
    kept = conform(doc, schemas.load(schemas.STATUS_SCHEMA)) if isinstance(doc, dict) else _DROP
    return kept if isinstance(kept, dict) else {}


def summary_doc(doc: Any) -> dict[str, Any]:
    """``summary.json`` (``launcher.summary/v1``, as result.v1.json describes it) made safe the same way."""
    kept = conform(doc, _summary_schema()) if isinstance(doc, dict) else _DROP
    return kept if isinstance(kept, dict) else {}


def plain_doc(doc: Any) -> dict[str, Any]:
    """Any other run-directory JSON object (``run.json``, ``spec.json``) with its strings made printable."""
    kept = _plain(doc, 0) if isinstance(doc, dict) else _DROP
    return kept if isinstance(kept, dict) else {}
