"""One way to write sizes and times everywhere — the widget, plan summaries and explanations, run summaries (the front
end's ``bytes``/``secs`` in planner.js follow the same rules): bytes in binary units chosen per value (B, KiB, MiB,
GiB, TiB), times in s, ms, µs or ns chosen per value, three significant digits."""

from __future__ import annotations

BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))


def _sig3(x: float) -> str:
    """3 significant digits without exponent: 1.23, 12.3, 123."""
    a = abs(x)
    return f"{x:.2f}" if a < 10 else f"{x:.1f}" if a < 100 else f"{x:.0f}"


def fmt_bytes(n: float | None) -> str:
    """'512 B', '8.00 KiB', '12.3 MiB', '1.02 GiB'."""
    if n is None:
        return "–"
    x, i = float(n), 0
    while abs(x) >= 1024 * 0.9995 and i < len(BYTE_UNITS) - 1:
        x /= 1024
        i += 1
    return f"{x:.0f} B" if i == 0 else f"{_sig3(x)} {BYTE_UNITS[i]}"


def fmt_time(s: float | None) -> str:
    """'1.23 s', '12.3 ms', '40.4 µs', '0 s'."""
    if s is None:
        return "–"
    if s == 0:
        return "0 s"
    for scale, unit in TIME_UNITS:
        if abs(s) >= scale * 0.9995 or unit == "ns":
            return f"{_sig3(s / scale)} {unit}"
    return f"{s} s"


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
            return f"{_sig3(x / scale)}{p}{unit}"
    return f"{x:.0f}{unit}"
