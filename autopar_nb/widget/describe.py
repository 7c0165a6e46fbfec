"""A front-end edit message in words: how the planner widget's answer to an edit starts."""

from __future__ import annotations

from typing import Any

from . import choices, editor


def describe(msg: dict[str, Any]) -> str:
    """A front-end edit message in words, as the widget's answer to it starts ("h.0: strategy
    colwise")."""
    kind = msg.get("kind")
    label = editor.STRATEGY_LABELS.get(msg.get("value"), msg.get("value"))
    layers = msg.get("layers") or ([msg["layer"]] if msg.get("layer") else [])
    who = msg.get("pattern") or (layers[0] if len(layers) == 1 else f"{len(layers)} layers")
    if kind == "strategy":
        return f"{msg.get('layer')}: strategy {label}"
    if kind == "shard":
        return f"{who} → {label}"
    if kind == "recompute":
        return f"{who}: recompute {msg.get('value')}"
    if kind == "stage":
        return f"{msg.get('layer')} -> stage {msg.get('stage')}"
    if kind == "boundary":
        return f"stage {msg.get('stage')} starts at {msg.get('layer')}"
    if kind == "global":
        return f"{choices.GLOBAL_NAMES.get(msg.get('key'), msg.get('key'))} = {msg.get('value')}"
    if kind == "precision":
        where = choices.OP_LISTS.get(msg.get("list"), msg.get("list"))
        return f"{msg.get('action', 'add')} {msg.get('op')!r} ({where})"
    if kind == "cluster":
        return f"cluster {msg.get('preset')} {msg.get('nodes')} x {msg.get('gpus_per_node')}"
    if kind == "adopt":
        return f"adopt alternative {int(msg.get('index', 0)) + 1}"
    if kind == "unpin":
        return f"{msg.get('layer')}: back to the planner's choice"
    return str(kind)
