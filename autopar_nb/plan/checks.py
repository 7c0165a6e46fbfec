"""Field checks: each names the field it reads, and raises :class:`PlanError` with what is
allowed."""

from __future__ import annotations

import math
from typing import Any

from .vocab import MAX_INT, MODULE_PATH


class PlanError(ValueError):
    """A plan that cannot be valid: the message says which field and why."""


def check_choice(what: str, value: Any, allowed: tuple) -> None:
    # type first (a vocabulary holds one type): True == 1 == 1.0, so `in` alone would take them for
    # zero_stage 1
    if type(value) is not type(allowed[0]) or value not in allowed:
        raise PlanError(f"{what}={value!r} is not supported; choose one of "
                        f"{', '.join(map(repr, allowed))}")


def check_int(what: str, value: Any, *, minimum: int | None = None, maximum: int = MAX_INT) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise PlanError(f"{what} must be >= {minimum}, got {value}")
    if value > maximum:
        raise PlanError(f"{what} must be <= {maximum}, got {value}")


def check_number(what: str, value: Any, *, minimum: float | None = None, below: float | None = None,
                  finite: bool = True) -> float:
    """The value as a float; PlanError unless it is an int or float (not a bool or a string) in
    range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"{what} must be a number, got {value!r} ({type(value).__name__})")
    if finite and not math.isfinite(value):
        raise PlanError(f"{what} must be finite, got {value!r}")
    if (minimum is not None and value < minimum) or (below is not None and value >= below):
        rng = f">= {minimum}" if below is None else f"in [{minimum}, {below})"
        raise PlanError(f"{what} must be {rng}, got {value!r}")
    return float(value)


def check_bool(what: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise PlanError(f"{what} must be true or false, got {value!r} ({type(value).__name__})")


def check_str(what: str, value: Any) -> None:
    if not isinstance(value, str):
        raise PlanError(f"{what} must be a string, got {value!r} ({type(value).__name__})")


def check_module_path(what: str, value: Any, *, root: bool) -> None:
    check_str(what, value)
    if not (value == "" and root) and not MODULE_PATH.fullmatch(value):
        raise PlanError(f"{what}={value!r} is not a module path: dotted names of letters, digits, "
                        "'_' and '-' (as nn.Module.named_modules() yields "
                        f"them){', or the root' if root else ''}")


def check_list(what: str, value: Any, kind: type) -> None:
    if not isinstance(value, list):
        raise PlanError(f"{what} must be a list, got {value!r} ({type(value).__name__})")
    for i, v in enumerate(value):
        if not isinstance(v, kind):
            raise PlanError(f"{what}[{i}] must be a {kind.__name__}, got {v!r} "
                            f"({type(v).__name__})")


def check_numbers(obj: Any, prefix: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        # a float passes (not finite allowed): checked without naming it (hot path)
        if type(value) is not float:
            check_number(f"{prefix}.{name}", value, finite=False)
