"""The values users write on the command line, parsed: sizes (4MB), link rates (1gbit),
latencies (250us), shapes (3x32x32) and comma lists (2,4,8). Each bad value is one line naming
what was expected."""

from __future__ import annotations

import re

from gradmesh.errors import GradmeshError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1 << 10,
    "K": 1 << 10,
    "MB": 1 << 20,
    "M": 1 << 20,
    "GB": 1 << 30,
    "G": 1 << 30,
}


def parse_size(text: str) -> int:
    """'4KB' -> 4096 (binary units, as nccl-tests use)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?B?)\s*", text.upper())
    if not m:
        raise GradmeshError(f"bad size {text!r}: expected a number with KB, MB or GB, like 4MB")
    if int(m.group(1)) == 0:
        raise GradmeshError(f"bad size {text!r}: it must be more than 0 bytes")
    return int(m.group(1)) * _UNITS[m.group(2)]


def parse_shape(text: str) -> tuple[int, ...]:
    """'1x8x8' -> (1, 8, 8)."""
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise GradmeshError(f"bad shape {text!r}: expected sizes joined by x, like 1x8x8") from None
    if not shape or any(s < 1 for s in shape):
        raise GradmeshError(f"bad shape {text!r}: every size must be >= 1")
    return shape


def parse_list(text: str, kind: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise GradmeshError(f"empty {kind} list")
    return items


def parse_ints(text: str, kind: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(v) for v in parse_list(text, kind)]
    except ValueError:
        raise GradmeshError(f"bad {kind} list {text!r}: expected integers like 2,4") from None
    if any(v < minimum for v in values):
        raise GradmeshError(f"every {kind} must be >= {minimum}, got {text}")
    return values


_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
}


def parse_rate(text: str) -> int:
    """A tc-style rate ('1gbit', '100mbit', '250mbps') in bits per second."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _RATE_UNITS:
        raise GradmeshError(f"bad bandwidth {text!r}: expected a rate like 1gbit or 100mbit")
    bits = int(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if bits < 8000:
        raise GradmeshError(f"bandwidth {text!r} is too low to emulate (minimum 8kbit)")
    return bits


def parse_latency(text: str) -> float:
    """'1ms', '250us', '0.5s' in seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*", text.lower())
    if not m:
        raise GradmeshError(f"bad latency {text!r}: expected a time like 1ms or 250us")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]
