"""export(path, target="k8s"): a ConfigMap with the script and a Kubeflow PyTorchJob whose pods run the script's
torchrun line, checked against the published PyTorchJob schema (tests/data, from kubeflow/training-operator v1.9.0)
with jsonschema, plus what Kubernetes' strict field validation adds (no field the schema does not know). Not run."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from runtime_cases import make_plan
from test_export import SRC, TP

from autopar_nb.export import export, torchrun_command
from autopar_nb.export.k8s import DNS_LABEL, pytorchjob_manifest, to_yaml

SCHEMA = json.loads((Path(__file__).parent / "data" / "kubeflow.org_pytorchjobs.v1.schema.json").read_text())


def _validate(job: dict) -> None:
    """The schema's checks, then Kubernetes' strict field validation: every field is one the schema declares."""
    jsonschema.Draft7Validator(SCHEMA).validate(job)
    _known_fields(job, SCHEMA, "")


def _known_fields(value, schema: dict, where: str) -> None:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key not in schema["properties"]:
                raise AssertionError(f"{where}.{key}: not a field of the schema (strict validation rejects it)")
            _known_fields(item, schema["properties"][key], f"{where}.{key}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            _known_fields(item, schema["additionalProperties"], f"{where}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _known_fields(item, schema["items"], f"{where}[{i}]")


def _gpu_plan():
    plan = make_plan(SRC, dp=8, tp=2, zero=3, tp_styles=TP, loss_parallel=True)
    plan.cluster = {"preset": "h100-80gb", "nodes": 2, "gpus_per_node": 8}
    return plan


def test_pytorchjob_matches_the_published_schema(tmp_path):
    plan = _gpu_plan()
    exported = export(SRC, plan, tmp_path / "train_big.py", quiet=True, target="k8s",
                      image="nvcr.io/nvidia/pytorch:25.01-py3")
    assert exported.job == tmp_path / "train_big.pytorchjob.yaml"
    assert exported.submit == ["kubectl apply -f train_big.pytorchjob.yaml"]
    config_map, job = yaml.safe_load_all(exported.job.read_text())
    _validate(job)
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert DNS_LABEL.fullmatch(job["metadata"]["name"]) and DNS_LABEL.fullmatch(config_map["metadata"]["name"])
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 1  # 2 pods of 8 processes
    for spec in specs.values():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # what the training operator looks for
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        # the script's own multi-node line, meeting at the master pod (the operator sets MASTER_ADDR/PORT)
        line = torchrun_command("/workspace/train_big.py", 2, 8, run_id="train-big",
                                endpoint="$(MASTER_ADDR):$(MASTER_PORT)")
        assert " ".join(container["command"]) == line + " --ckpt-dir /checkpoints/train-big --ckpt-every 100"
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
        assert mounts == {"script": "/workspace", "checkpoints": "/checkpoints", "shm": "/dev/shm"}
        assert volumes["script"]["configMap"]["name"] == config_map["metadata"]["name"]
        assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "train-big-checkpoints"
    # the pods run the very script export wrote, and its plan
    assert config_map["kind"] == "ConfigMap"
    assert config_map["data"]["train_big.py"] == exported.script.read_text()
    assert config_map["data"]["train_big_runtime.py"] == exported.runtime.read_text()  # what it imports
    assert config_map["data"]["train_big.plan.json"] == exported.plan_json.read_text()
    assert len(exported.job.read_bytes()) < 1 << 20  # a ConfigMap holds at most 1 MiB


def test_single_node_cpu_job_and_options():
    plan = make_plan(SRC, dp=2)
    text = pytorchjob_manifest("train.py", plan, script_text="print('hi')\n", plan_text="{}\n", namespace="ml",
                               ckpt_claim="shared-ckpt", backoff_limit=5)
    config_map, job = yaml.safe_load_all(text)
    _validate(job)
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]  # one pod: no workers, no rendezvous endpoint
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert container["command"][:3] == ["torchrun", "--nproc-per-node", "2"] and "resources" not in container
    assert job["metadata"]["namespace"] == config_map["metadata"]["namespace"] == "ml"
    assert job["spec"]["runPolicy"]["backoffLimit"] == 5
    with pytest.raises(ValueError):
        pytorchjob_manifest("train.py", plan, script_text="", plan_text="", namespace="Not_A_Name")
    with pytest.raises(ValueError):
        pytorchjob_manifest("train.py", plan, script_text="", plan_text="", image="x; rm -rf /")


def test_the_schema_check_has_teeth():
    """Manifests the schema (or strict validation) rejects are rejected here too."""
    _, job = yaml.safe_load_all(pytorchjob_manifest("train.py", _gpu_plan(), script_text="x\n", plan_text="{}\n"))
    bad_replicas = json.loads(json.dumps(job))
    bad_replicas["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "one"
    no_image_name = json.loads(json.dumps(job))
    del no_image_name["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"]
    typo = json.loads(json.dumps(job))
    typo["spec"]["runPolicy"]["backofLimit"] = 3
    for broken in (bad_replicas, no_image_name):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft7Validator(SCHEMA).validate(broken)
    jsonschema.Draft7Validator(SCHEMA).validate(typo)  # the schema alone lets an unknown field through ...
    with pytest.raises(AssertionError, match="backofLimit"):
        _validate(typo)  # ... strict field validation does not


def test_yaml_writer_round_trips():
    doc = {"a": "line\n  indented\n\n", "b": ["x", {"c": "true", "d": 1, "e": "$(X):$(Y)"}], "f": "", "g": {}}
    assert yaml.safe_load(to_yaml(doc)) == doc
