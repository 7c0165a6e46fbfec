"""The Kubernetes manifest of ``export(path, target="k8s")``: a ConfigMap holding the script and its
plan, and a Kubeflow ``PyTorchJob`` (``kubeflow.org/v1``, the training operator) whose pods each run
the script's torchrun line, meeting at the master pod (the operator's
``MASTER_ADDR``/``MASTER_PORT``) with c10d rendezvous."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

from ..plan import Plan
from .commands import layout, torchrun_command

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
"""Kubernetes object names (RFC 1123 labels, at most 63 characters)"""
PLAIN = re.compile(r"[A-Za-z0-9_./-][A-Za-z0-9_./:-]*")
"""YAML scalars written without quotes (when they do not read as another type)"""
NOT_STRINGS = re.compile(
    r"(?i)(true|false|yes|no|on|off|y|n|null|~|[-+]?(\d[\d_]*)?\.?\d*([eE][-+]?\d+)?|\.inf|\.nan)")


def k8s_name(text: str) -> str:
    """``text`` as a Kubernetes object name: lower case, ``-`` for anything else, at most 63
    characters."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:63].strip("-")
    if not name:
        raise ValueError(f"{text!r} gives no Kubernetes name: pass name=")
    return name


def pytorchjob_manifest(script: str, plan: Plan, *, script_text: str, plan_text: str,
                        name: str | None = None, image: str = "pytorch/pytorch:latest",
                        namespace: str | None = None, nodes: int | None = None,
                        gpus_per_node: int | None = None, ckpt_claim: str | None = None,
                        ckpt_every: int = 100, backoff_limit: int = 3,
                        files: dict[str, str] | None = None) -> str:
    """The manifest (YAML, two documents) for running ``script`` with ``plan``; ``files``: more
    files for the script's folder, by name (its runtime module).

    ``image``: a container image with torch (and the cell's imports). ``nodes``: pods sharing the
    plan's processes (default: one when the plan fits a node, else the plan's cluster).
    ``gpus_per_node``: ``nvidia.com/gpu`` per pod (default: the processes per pod for GPU plans,
    none for CPU plans). ``ckpt_claim``: a ReadWriteMany PersistentVolumeClaim for the DCP
    checkpoints (default ``<name>-checkpoints``; create it first), so a restarted job resumes from
    the newest complete one. ``backoff_limit``: restarts before the job fails.
    """
    lay, world = layout(plan), plan.mesh.world_size
    name = k8s_name(name or Path(script).stem)
    nodes = nodes or lay.nodes
    if nodes < 1 or world % nodes:
        raise ValueError(f"nodes={nodes} must divide the plan's {world} processes")
    per_node = world // nodes
    gpus = gpus_per_node if gpus_per_node is not None else (per_node if lay.gpus else 0)
    claim = k8s_name(ckpt_claim or f"{name}-checkpoints")
    if namespace is not None and not DNS_LABEL.fullmatch(namespace):
        raise ValueError(f"namespace={namespace!r} is not a Kubernetes name (lower case letters, "
                         "digits, '-')")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_./:@-]*", image):
        raise ValueError(f"image={image!r} is not an image reference")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*\.py", script):
        raise ValueError(f"script={script!r}: a file name of letters, digits, '_', '.', '-' ending "
                         "in .py")
    command = torchrun_command(f"/workspace/{script}", nodes, per_node, run_id=name,
                               endpoint="$(MASTER_ADDR):$(MASTER_PORT)")
    command += f" --ckpt-dir /checkpoints/{name} --ckpt-every {int(ckpt_every)}"
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    container = {
        "name": "pytorch",  # the training operator finds the container by this name
        "image": image,
        "command": command.split(" "),
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        **({"resources": {"limits": {"nvidia.com/gpu": gpus}}} if gpus else {}),
        "volumeMounts": [{"name": "script", "mountPath": "/workspace", "readOnly": True},
                         {"name": "checkpoints", "mountPath": "/checkpoints"},
                         {"name": "shm", "mountPath": "/dev/shm"}],
    }
    pod = {"spec": {"containers": [container],
                    "volumes": [{"name": "script", "configMap": {"name": f"{name}-script"}},
                                {"name": "checkpoints",
                                 "persistentVolumeClaim": {"claimName": claim}},
                                {"name": "shm", "emptyDir": {"medium": "Memory"}}]}}
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}}
    if nodes > 1:
        replicas["Worker"] = {"replicas": nodes - 1, "restartPolicy": "OnFailure", "template": pod}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {**meta, "name": f"{name}-script"},
                  "data": {script: script_text, **(files or {}),
                           Path(script).stem + ".plan.json": plan_text}}
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": meta,
           "spec": {"runPolicy": {"backoffLimit": int(backoff_limit), "cleanPodPolicy": "None"},
                    "pytorchReplicaSpecs": replicas}}
    header = textwrap.wrap(
        f"Kubeflow PyTorchJob for {script} ({plan.summary()}), written by autopar-nb: kubectl "
        f"apply -f {Path(script).stem}.pytorchjob.yaml. {nodes} pod{'s' * (nodes != 1)} x "
        f"{per_node} process{'es' * (per_node != 1)}: every pod runs the same torchrun line and "
        "they meet at the master pod. Needs the Kubeflow training operator, an image with torch, "
        f"and a ReadWriteMany PersistentVolumeClaim {claim} for the checkpoints (a restarted job "
        "resumes from the newest complete one).", width=118,
        initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False, break_long_words=False)
    return "\n".join(header) + "\n" + to_yaml(config_map) + "---\n" + to_yaml(job)


def to_yaml(value, indent: int = 0) -> str:
    """Plain data (dicts, lists, strings, numbers, bools) as block-style YAML; multi-line strings as
    literal blocks."""
    return "\n".join(_lines(value, indent)) + "\n"


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if value is None:
        return "null"
    if PLAIN.fullmatch(value) and not NOT_STRINGS.fullmatch(value):
        return value
    return json.dumps(value)  # a JSON string is a YAML double-quoted scalar


def _fits_block(text: str) -> bool:
    """Multi-line text that a literal block keeps exactly (printable characters, tabs and newlines
    only)."""
    return "\n" in text and bool(text.strip("\n")) and all(c in "\n\t" or c.isprintable()
                                                           for c in text)


def _block(text: str, pad: str) -> list[str]:
    """A literal block scalar (``|``) keeping ``text`` byte for byte."""
    chomp = "-" if not text.endswith("\n") else "+" if text.endswith("\n\n") else ""
    indicator = "2" if text[:1] in (" ", "\n") else ""
    body = text[:-1] if text.endswith("\n") else text
    return [f"|{indicator}{chomp}"] + [(pad + line) if line else "" for line in body.split("\n")]


def _lines(value, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict):
        out = []
        for key, item in value.items():
            if isinstance(item, dict | list) and item:
                out.append(f"{pad}{_scalar(str(key))}:")
                out += _lines(item, indent + 2)
            elif isinstance(item, str) and _fits_block(item):
                first, *rest = _block(item, pad + "  ")
                out += [f"{pad}{_scalar(str(key))}: {first}", *rest]
            else:
                empty = {dict: "{}", list: "[]"}.get(type(item))
                out.append(f"{pad}{_scalar(str(key))}: {empty or _scalar(item)}")
        return out
    if isinstance(value, list):
        out = []
        for item in value:
            if isinstance(item, dict | list) and item:
                inner = _lines(item, indent + 2)
                out.append(f"{pad}- {inner[0].lstrip()}")
                out += inner[1:]
            else:
                out.append(f"{pad}- {_scalar(item)}")
        return out
    return [pad + _scalar(value)]
