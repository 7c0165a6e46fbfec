"""The soak's short version (bench/soak.py): an exported FSDP script on 2 processes, killed three times (a worker:
the elastic agent restarts the group; the agent itself: the soak launches the command again), ends with every
step's loss equal to an uninterrupted run's, no process left and no file descriptor leaked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from soak import export_script, soak


@pytest.mark.multiprocess
def test_three_kills_leave_the_loss_curve_of_an_uninterrupted_run(tmp_path):
    script = export_script(tmp_path, hidden=256, steps=900)
    report = soak(script, steps=900, ckpt_every=25, kill_every=(2, 4), kills=3, seed=1, workdir=tmp_path / "soak",
                  progress=print)
    print(report)
    assert len(report.kills) == 3 and {k.kind for k in report.kills} == {"worker", "agent"}  # seed 1 draws both
    assert report.ok, report
    assert report.launches == 1 + sum(k.kind == "agent" for k in report.kills)
    for k in report.kills:  # each resumed from a checkpoint at most ckpt_every steps back, and made progress again
        assert k.resumed_at is not None and k.resumed_at % 25 == 0 and 0 <= k.redone <= 25 and k.lost_s > 0
