"""One way to write sizes and times everywhere — the widget, plan summaries and explanations, run
summaries (the front end's ``bytes``/``secs`` in planner.js follow the same rules): bytes in binary
units chosen per value (B, KiB, MiB, GiB, TiB), times in s, ms, µs or ns chosen per value, three
significant digits. Sizes and times are :mod:`autopar_nb.runtime.units`' (an exported script prints
its own lines with them), counts and rates are here."""

from __future__ import annotations

from .runtime.units import TIME_UNITS, fmt_bytes, fmt_time, sig3

__all__ = ["fmt_bytes", "fmt_count", "fmt_delta", "fmt_flops", "fmt_time", "parse_time"]
TIME_TEXT = r"[\d.]+ (?:s|ms|µs|ns)"
"""a time as :func:`fmt_time` writes it, for a regular expression"""


def fmt_delta(s: float) -> str:
    """A signed time difference: '+1.23 ms', '-40.4 µs'."""
    return ("-" if s < 0 else "+") + fmt_time(abs(s))


def fmt_flops(rate: float | None) -> str:
    """FLOP/s: '312 TFLOP/s', '1.23 GFLOP/s', '850 FLOP/s'."""
    text = fmt_count(rate)
    return f"{text[:-1]} {text[-1]}FLOP/s" if text[-1:].isalpha() else f"{text} FLOP/s"


def fmt_count(x: float | None, unit: str = "") -> str:
    """'512', '75.0k', '1.51M', '6.74G' (+ unit): parameters, FLOPs, tokens."""
    if x is None:
        return "–"
    for scale, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale * 0.9995:
            return f"{sig3(x / scale)}{p}{unit}"
    return f"{x:.0f}{unit}"


def parse_time(text: str) -> float:
    """Seconds from :func:`fmt_time`'s text: '12.3 ms' -> 0.0123."""
    value, unit = text.split()
    return float(value) * next(scale for scale, u in TIME_UNITS if u == unit)
