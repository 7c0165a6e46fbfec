"""Sizes and times as people read them: bytes in binary units chosen per value (B, KiB, MiB, GiB,
TiB), times in s, ms, µs or ns chosen per value, three significant digits. The one formatter of the
package (``autopar_nb.units`` re-exports it) and of an exported script's own lines (the step line,
the checkpoint notes)."""

from __future__ import annotations

TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))


def sig3(x: float) -> str:
    """3 significant digits without exponent: 1.23, 12.3, 123."""
    a = abs(x)
    return f"{x:.2f}" if a < 10 else f"{x:.1f}" if a < 100 else f"{x:.0f}"


def fmt_bytes(n: float | None) -> str:
    """'512 B', '8.00 KiB', '12.3 MiB', '1.02 GiB'."""
    if n is None:
        return "–"
    x, i, units = float(n), 0, ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    while abs(x) >= 1024 * 0.9995 and i < len(units) - 1:
        x /= 1024
        i += 1
    return f"{x:.0f} B" if i == 0 else f"{sig3(x)} {units[i]}"


def fmt_time(s: float | None) -> str:
    """'1.23 s', '12.3 ms', '40.4 µs', '0 s'."""
    if s is None:
        return "–"
    if s == 0:
        return "0 s"
    for scale, unit in TIME_UNITS:
        if abs(s) >= scale * 0.9995 or unit == "ns":
            return f"{sig3(s / scale)} {unit}"
    return f"{s} s"
