"""Sizes and durations as people write them: the one parser for ``8GiB``, ``500MB``, ``90s``, ``1h30m``.

It lives apart from the GPU selector (nvitop keeps ``human2bytes`` in ``api/utils`` for the same reason) so
config, progress and plan read sizes without importing GPU code.
"""

from __future__ import annotations

import math
import re

from launcher.errors import BadInput

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*$")


def parse_size(value: str | int, *, what: str = "size") -> int:
    """Parse a memory size into bytes.

    Accepts a plain byte count or a number with a unit: ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024),
    ``KB``/``MB``/``GB``/``TB`` (powers of 1000) and Docker's one-letter ``k``/``m``/``g``/``t`` (powers of
    1024); case-insensitive. ``"8GiB"`` -> 8589934592, ``"500MB"`` -> 500000000.

    Args:
        value: the text (or an int, taken as bytes).
        what: how to name the value in an error, e.g. ``"--min-free-memory"``.

    Raises:
        BadInput: not a non-negative size.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise BadInput(f"{what} must not be negative, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise BadInput(
            f"{what}: cannot read {value!r} as a memory size",
            hint="write a number with a unit, e.g. 8GiB, 500MB, 1.5g or a byte count",
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(n_bytes: int | None) -> str:
    """``85899345920`` -> ``"80.0 GiB"`` (binary units, one decimal); ``None`` -> ``"?"``."""
    if n_bytes is None:
        return "?"
    size = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover


def parse_duration(text: str | float | int) -> float:
    """Parse ``90``, ``90s``, ``15m``, ``1h30m`` into seconds (> 0).

    Raises:
        ValueError: not a duration, or not above zero (the message gives examples).
    """
    if isinstance(text, bool):
        raise ValueError(f"expected a duration, got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _DURATION.match(text)
        if not m or not any(m.groups()):
            raise ValueError(f"{text!r} is not a duration (examples: 90, 90s, 15m, 1h30m)")
        h, mi, s = (float(x) if x else 0.0 for x in m.groups())
        value = h * 3600 + mi * 60 + s
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"duration must be > 0, got {text!r}")
    return value
