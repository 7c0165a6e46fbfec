"""export() and the files already there (issue 17 point 5): a file the user wrote is never overwritten without
``overwrite=True`` (nothing at all is written then); an earlier export's script, plan JSON and job file are
recognised by their contents and replaced."""

from __future__ import annotations

import pytest
from runtime_cases import make_plan
from test_export import CELL

from autopar_nb.export import export, written_by_export
from autopar_nb.source import ModelSource

SOURCE = ModelSource(CELL)


@pytest.fixture(scope="module")
def plan():
    return make_plan(SOURCE, dp=2)


@pytest.mark.parametrize("target, user_file", [("torchrun", "train.py"), ("torchrun", "train_runtime.py"),
                                               ("torchrun", "train.plan.json"),
                                               ("slurm", "train.sbatch"), ("k8s", "train.pytorchjob.yaml")])
def test_a_users_file_is_kept_and_nothing_is_written(tmp_path, plan, target, user_file):
    mine = tmp_path / user_file
    mine.write_text("# my own notes, not an export\n")
    with pytest.raises(FileExistsError, match=f"{user_file} exists and was not written by ap.export.*overwrite=True"):
        export(SOURCE, plan, tmp_path / "train.py", target=target, quiet=True)
    assert mine.read_text() == "# my own notes, not an export\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [user_file]  # nothing else written either


def test_an_earlier_export_is_replaced_and_overwrite_replaces_anything(tmp_path, plan):
    first = export(SOURCE, plan, tmp_path / "train.py", target="slurm", quiet=True)
    for p in (first.script, first.runtime, first.plan_json, first.job):
        assert written_by_export(p), p
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.plan.json", "train.py", "train.sbatch",
                                                          "train_runtime.py"]
    single = export(SOURCE, plan, tmp_path / "one.py", quiet=True, single_file=True)
    assert single.runtime is None and written_by_export(single.script) and not (tmp_path / "one_runtime.py").exists()
    first.script.write_text(first.script.read_text().replace("Train ", "Train again ", 1))
    export(SOURCE, plan, tmp_path / "train.py", target="slurm", quiet=True)  # recognised: replaced
    assert "Train again" not in first.script.read_text()
    first.plan_json.write_bytes(b"\xff\xfe not text")
    export(SOURCE, plan, tmp_path / "train.py", quiet=True, overwrite=True)
    assert written_by_export(first.plan_json)


@pytest.mark.parametrize("name, text", [
    ("train.py", "print('hello')\n"),
    ("train.py", '"""Train my way."""\n# autopar_nb/runtime/ mentioned in passing\n'),
    ("train_runtime.py", '"""The runtime of my own training."""\n# autopar_nb/runtime/ mentioned in passing\n'),
    ("train.plan.json", '{"mesh": 1}'),
    ("train.plan.json", "[" * 100000),
    ("train.sbatch", "#!/bin/bash\nsrun python train.py\n"),
])
def test_what_is_not_an_export(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    assert not written_by_export(p)
