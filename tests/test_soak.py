"""The soak's short version (bench/soak.py): an exported FSDP script on 2 processes, killed three times (a worker:
the elastic agent restarts the group; the agent itself: the soak launches the command again), ends with every
step's loss equal to an uninterrupted run's, no process left and no file descriptor leaked; the same with whole
nodes (network namespaces; root only) killed twice."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from netns import SUBNET, unavailable
from soak import export_for_nodes, export_script, soak, soak_nodes


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


@pytest.mark.multiprocess
def test_node_kills_leave_the_loss_curve_of_an_uninterrupted_run(tmp_path):
    """Two nodes (network namespaces, one process each, elastic torchrun); seed 1 kills the first node (the
    rendezvous host: the second must end by itself, leaving nothing behind, and the soak launches both again), then
    the second (the first trains on alone and the second rejoins). Every step's loss equals the uninterrupted
    run's."""
    why = unavailable()
    if why:
        pytest.skip(why)
    script, command = export_for_nodes(tmp_path, hidden=256, steps=2400)
    report = soak_nodes(script, command, steps=2400, ckpt_every=25, kill_every=(2, 4), away=(2, 4), kills=2, seed=1,
                        workdir=tmp_path / "soak", progress=print)
    print(report)
    assert [k.node for k in report.kills] == [0, 1] and report.launches == 2
    assert report.ok, report
    host, other = report.kills
    assert host.other_end_s is not None and host.other_end.startswith("exit 1:"), host.other_end  # nothing left
    # the lost node named once, and the run failed as soon as the other node's rank ended (not restart_wait_s later)
    assert host.dashboard.startswith("failed:") and f"node {SUBNET}.1 lost (rank 0)" in host.dashboard, host.dashboard
    for k in report.kills:  # resumed from a checkpoint, and both nodes trained again
        assert k.resumed_at is not None and k.resumed_at % 25 == 0 and 0 <= k.redone <= 25 and k.back_s > 0
