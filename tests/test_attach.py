"""Attaching the dashboard to a run on other hosts (issue 15 point 6): an AttachedRun has no local process and reads
everything from the metrics stream; ranks that close without an end message, go silent or never come are lost.

These tests play the ranks with plain sockets on loopback; tests/test_multinode.py runs the exported script under
torchrun in a network namespace streaming to an attached run across a veth pair.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from autopar_nb.launch import LaunchError, attach
from autopar_nb.launch.attached import check_host, rendezvous_host


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Rank:
    """One fake rank: the exported script's side of the protocol (runtime/metrics.py)."""

    def __init__(self, run, rank: int, token: str | None = None, source: str | None = None, **elastic):
        host, port = run.address.rsplit(":", 1)  # source: another loopback address plays another host
        self.sock = socket.create_connection((host, int(port)), source_address=(source, 0) if source else None)
        self.send({"token": token or run.env["AUTOPAR_TOKEN"], "rank": rank, **elastic})
        self.send({"event": "start", "pid": 1, "rss_before_model": 100e6, "stacks": True})

    def send(self, record: dict) -> None:
        self.sock.sendall((json.dumps(record) + "\n").encode())

    def step(self, k: int) -> None:
        self.send({"step": k, "loss": 1.0 / (k + 1), "step_time_s": 0.01, "samples_per_s": 100.0,
                   "data_wait_s": 0.001, "rss": 150e6})

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def runs():
    made = []

    def make(nproc=2, **kw):
        kw.setdefault("lost_after_s", 30.0)
        run = attach("train.py", nproc, 3, host="127.0.0.1", **kw)
        made.append(run)
        return run

    yield make
    for run in made:
        run.stop()


def test_a_run_that_every_rank_finishes_is_finished_from_the_stream_alone(runs):
    run = runs()
    assert run.status == "starting" and "127.0.0.1" in run.address
    assert run.commands == [] and run.env["AUTOPAR_METRICS"] == run.address
    ranks = [Rank(run, r) for r in range(2)]
    for k in range(3):
        for r in ranks:
            r.step(k)
    for r in ranks:
        r.send({"event": "done"})
        r.close()
    assert run.wait(10) == "finished", run.message
    assert run.summary()["steps"] == 3 and run.loss_curve(1) == [(0, 1.0), (1, 0.5), (2, 1 / 3)]
    assert run.processes() == [] and run.workers() == {} and run.logs(0) == ""
    last = [s for s in run.samples if s["rank"] == 0][-1]
    assert last["state"] == "finished" and last["source"] == "stream"
    assert last["memory_bytes"] == pytest.approx(50e6)  # its RSS at the step, above the RSS before its model
    board = run.dashboard()
    assert [r["state"] for r in board.ranks] == ["finished", "finished"]
    assert board.info["run_device"].endswith(f"on other hosts, streaming to {run.address}")
    assert board.info["limit"] is None  # this host's RAM says nothing about theirs


def test_the_data_wait_verdict_is_kept_and_said(runs):
    """Issue 18 point 2: the script's {"event": "data"} verdict is recorded on the run, joins its end message and its
    summary, and reaches the dashboard; a malformed one is ignored."""
    run = runs(nproc=1)
    rank = Rank(run, 0)
    rank.step(0)
    rank.send({"event": "data", "data_wait_share": "lots", "bottleneck": True, "message": "x"})  # ignored
    text = "data loading is the bottleneck: a rank waited 40% of its step time for batches; try more workers"
    rank.send({"event": "data", "data_wait_share": 0.4, "bottleneck": True, "message": text})
    rank.send({"event": "done"})
    rank.close()
    assert run.wait(10) == "finished"
    assert run.data == {"share": 0.4, "bottleneck": True, "message": text}
    assert run.summary()["data"] == run.data and run.message.endswith(f"; {text}")
    assert run.dashboard().summary["data"] == run.data


def test_a_silent_rank_is_lost_after_the_timeout_and_the_run_fails(runs):
    run = runs(lost_after_s=0.6)
    a, b = Rank(run, 0), Rank(run, 1)
    a.step(0), b.step(0)
    a.send({"event": "done"})
    wait_for(lambda: run.ranks()[0].done and run.ranks()[1].step == 0, 5, "rank 0's done, rank 1's step")
    assert run.status == "running" and run.ranks()[1].state(run.status) == "running"  # not lost before the timeout
    assert run.wait(10) == "failed"  # rank 1 keeps its connection open and says nothing
    st = run.ranks()[1]
    assert st.state(run.status) == "lost" and st.lost.startswith("it sent nothing for")
    assert run.error["rank"] == 1 and run.error["error"].startswith("lost: it sent nothing")
    assert run.message.startswith("failed: rank 1: lost")
    a.close(), b.close()


def test_a_connection_closed_without_an_end_message_is_lost_at_once(runs):
    run = runs()
    a, b = Rank(run, 0), Rank(run, 1)
    a.step(0), b.step(0)
    b.close()  # killed: no "done", no "error"
    wait_for(lambda: run.ranks()[1].lost is not None, 5, "rank 1 lost")
    assert "connection from 127.0.0.1 closed without an end message" in run.ranks()[1].lost  # its host named
    assert run.status == "running"  # rank 0 goes on
    assert not [e for e in run.events if e["kind"] == "node_lost"]  # rank 0 of its host is still there
    a.send({"event": "error", "error": "RuntimeError: Connection closed by peer", "traceback": "tb"})
    assert run.wait(10) == "failed"
    assert run.error["rank"] == 1 and [k["rank"] for k in run.error["knock_on"]] == [0]
    a.close()


def test_a_rank_that_never_connects_is_lost(runs):
    run = runs(lost_after_s=0.5)
    a = Rank(run, 0)
    a.step(0)
    a.send({"event": "done"})
    assert run.wait(10) == "failed"
    assert "never connected" in run.ranks()[1].lost
    a.close()


def test_an_elastic_restart_is_followed(runs):
    """torchrun --max-restarts 3: a rank dies, its peer fails, the group restarts (attempt 1) and finishes: the run
    says "restarting", then follows the new attempt to "finished"."""
    run = runs(restart_wait_s=30)
    first = [Rank(run, r, attempt=0, max_restarts=3, world=2) for r in range(2)]
    for r in first:
        r.step(0)
    first[1].close()  # its node is killed
    first[0].send({"event": "error", "error": "RuntimeError: Connection closed by peer", "traceback": "tb"})
    wait_for(lambda: run.status == "restarting", 5, "restarting")
    time.sleep(0.3)
    assert not run.done and run.max_restarts == 3  # learnt from the hellos
    again = [Rank(run, r, attempt=1, max_restarts=3, world=2) for r in range(2)]
    for k in (1, 2):
        for r in again:
            r.step(k)
    for r in again:
        r.send({"event": "done"})
        r.close()
    first[0].close()
    assert run.wait(10) == "finished", run.message
    assert [st.state(run.status) for st in run.ranks().values()] == ["finished", "finished"]
    assert sorted({(r["attempt"], r["step"]) for r in run.metrics}) == [(0, 0), (1, 1), (1, 2)]


def test_a_restart_without_the_lost_node_finishes_at_the_smaller_world(runs):
    """--nnodes 1:2: the second node is lost, the first goes on alone (world 1) and finishes: the run finishes, and
    the rank that left with its node is "lost" without failing it."""
    run = runs(restart_wait_s=30)
    a, b = Rank(run, 0, attempt=0, max_restarts=3, world=2), Rank(run, 1, attempt=0, max_restarts=3, world=2)
    a.step(0), b.step(0)
    b.close()
    a.send({"event": "error", "error": "RuntimeError: Connection closed by peer", "traceback": "tb"})
    a.close()
    wait_for(lambda: run.status == "restarting", 5, "restarting")
    alone = Rank(run, 0, attempt=1, max_restarts=3, world=1)
    alone.step(1)
    alone.send({"event": "done"})
    alone.close()
    assert run.wait(10) == "finished", run.message
    assert run.world == 1 and run.ranks()[1].state(run.status) == "lost"
    assert "torchrun restarted the job with 1 rank(s)" in run.ranks()[1].lost


def test_a_node_that_rejoins_starts_a_new_attempt_whatever_its_agent_counts(runs):
    """--nnodes 1:2 after the lost node returns: the survivor's agent restarts its worker for the bigger world (a
    membership change: its count stays 1), the returning node's fresh agent counts 0; the notebook counts attempt 2
    (0: both, 1: alone, 2: both again) and finishes with both ranks."""
    run = runs(restart_wait_s=30)
    a, b = Rank(run, 0, attempt=0, max_restarts=3, world=2), Rank(run, 1, attempt=0, max_restarts=3, world=2)
    a.step(0), b.step(0)
    b.close()
    a.send({"event": "error", "error": "RuntimeError: Connection closed by peer", "traceback": "tb"})
    a.close()
    wait_for(lambda: run.status == "restarting", 5, "restarting after the loss")
    alone = Rank(run, 0, attempt=1, max_restarts=3, world=1)
    alone.step(1)
    wait_for(lambda: run.world == 1 and run.ranks()[0].step == 1, 5, "the world-1 attempt")
    alone.close()  # the agent ends it to admit the returning node: no end message
    wait_for(lambda: run.status == "restarting", 5, "restarting for the returning node")
    both = [Rank(run, 0, attempt=1, max_restarts=3, world=2), Rank(run, 1, attempt=0, max_restarts=3, world=2)]
    for r in both:
        r.step(2)
        r.send({"event": "done"})
        r.close()
    assert run.wait(10) == "finished", run.message
    assert run.world == 2 and [st.attempt for st in run.ranks().values()] == [2, 2]
    assert [(r["attempt"], r["step"]) for r in run.metrics if r["rank"] == 0] == [(0, 0), (1, 1), (2, 2)]


def node_events(run) -> list[str]:
    return [e["reason"] for e in run.events if e["kind"] == "node_lost"]


def two_nodes(run, nproc: int = 4) -> list[Rank]:
    """Ranks 0-1 on "host" 127.0.0.2, 2-3 on 127.0.0.3, one step each, under torchrun --max-restarts 3."""
    ranks = [Rank(run, r, source=f"127.0.0.{2 + r // 2}", attempt=0, max_restarts=3, world=nproc)
             for r in range(nproc)]
    for r in ranks:
        r.step(0)
    wait_for(lambda: all(st.step == 0 for st in run.ranks().values()), 5, "every rank's step")
    return ranks


def test_a_lost_rendezvous_node_is_one_event_and_fails_the_run_when_the_others_end(runs):
    """The node hosting the rendezvous is lost: one "node_lost" event names it and its ranks (not one per rank);
    once the other node's ranks end (its torchrun cannot meet again) the run fails at once, not after
    restart_wait_s."""
    run = runs(nproc=4, restart_wait_s=60, rendezvous="127.0.0.2:29400")
    ranks = two_nodes(run)
    ranks[0].close(), ranks[1].close()  # the node is killed: no end message
    wait_for(lambda: node_events(run), 5, "the node's event")
    time.sleep(0.5)  # a later tick adds nothing
    assert node_events(run) == [
        "node 127.0.0.2 lost (ranks 0-1): the connections of all its ranks closed within "
        f"{run.ranks()[1].closed_at - run.ranks()[0].closed_at:.1f} s without an end message; it hosted the "
        "rendezvous, so torchrun cannot restart the group"]
    assert run.status == "restarting" and run.message.startswith("node 127.0.0.2 lost (ranks 0-1)")
    assert any(e["kind"] == "node_lost" for e in run.dashboard().events)
    t0 = time.monotonic()
    for r in ranks[2:]:
        r.send({"event": "error", "error": "RuntimeError: Connection closed by peer", "traceback": "tb"})
        r.close()
    assert run.wait(10) == "failed" and time.monotonic() - t0 < 10, run.message
    assert "node 127.0.0.2 lost (ranks 0-1)" in run.message and "every other rank has ended" in run.message
    assert "connection from 127.0.0.2 closed" in run.message  # the first lost rank, as before


def rendezvous_host_lost(run) -> list[Rank]:
    """One rank per host (127.0.0.2 hosts the rendezvous), one step each, then the rendezvous host's rank closed
    without an end message: the stream infers its node lost."""
    ranks = [Rank(run, r, source=f"127.0.0.{2 + r}", attempt=0, max_restarts=3, world=2) for r in range(2)]
    for r in ranks:
        r.step(0)
    wait_for(lambda: all(st.step == 0 for st in run.ranks().values()), 5, "every rank's step")
    ranks[0].close()
    wait_for(lambda: node_events(run), 5, "the inferred node loss")
    return ranks


def test_ranks_of_the_rendezvous_host_that_end_while_its_agent_answers_are_no_lost_node(runs):
    """One rank per host, the rendezvous host's rank killed: on the stream that is a lost node (its only connection
    closed, then the other host's rank stopped by its agent), but the agent on that host lives and hosts the store,
    so its rendezvous port answers: the event is withdrawn, the run waits for the restart, and follows it to the
    end (a soak of whole nodes with worker kills marked such a run failed while torchrun restarted it)."""
    with socket.create_server(("127.0.0.2", 0)) as store:  # the agent's rendezvous store
        run = runs(nproc=2, restart_wait_s=60, rendezvous=f"127.0.0.2:{store.getsockname()[1]}")
        ranks = rendezvous_host_lost(run)
        ranks[1].close()  # its agent stops it to restart the group
        wait_for(lambda: not node_events(run), 5, "the event withdrawn")
        time.sleep(0.5)
        assert run.status == "restarting" and not run.done, run.message
        assert "its torchrun agent answers at the rendezvous" in run.message
        again = [Rank(run, r, source=f"127.0.0.{2 + r}", attempt=1, max_restarts=3, world=2) for r in range(2)]
        for r in again:
            r.step(1)
            r.send({"event": "done"})
            r.close()
        assert run.wait(10) == "finished", run.message
        assert not node_events(run)


def test_a_killed_rendezvous_agent_that_answers_for_a_moment_still_fails_the_run(runs):
    """A whole node killed at once: its agent's listening socket can outlive its ranks' connections for a moment,
    so the first probe answers. The probe is asked again: once the port is gone the "node_lost" event is back and
    the run fails at once (CI's node soak waited in "restarting" for restart_wait_s after such a kill)."""
    store = socket.create_server(("127.0.0.2", 0))
    run = runs(nproc=2, restart_wait_s=60, rendezvous=f"127.0.0.2:{store.getsockname()[1]}")
    ranks = rendezvous_host_lost(run)
    ranks[1].send({"event": "error", "error": "RuntimeError: Connection closed by peer", "traceback": "tb"})
    ranks[1].close()
    wait_for(lambda: not node_events(run), 5, "the event withdrawn while the port answers")
    t0 = time.monotonic()
    store.close()  # the agent's process ends
    assert run.wait(10) == "failed" and time.monotonic() - t0 < 10, run.message
    assert len(node_events(run)) == 1 and node_events(run)[0].startswith("node 127.0.0.2 lost (rank 0)")
    assert "node 127.0.0.2 lost (rank 0)" in run.message and "every other rank has ended" in run.message


def test_a_lost_node_without_the_rendezvous_waits_for_the_restart(runs):
    """The other node is lost (the rendezvous, read from the torchrun command, survives): one event, and the
    survivors' restart at world 2 is followed, and the node's return (world 4) to the end. Their agent ends them
    without an end message after the loss and again to admit the returning node: no event for their host (the
    consequence of the other's loss; then the only host), and the run does not fail."""
    run = runs(nproc=4, restart_wait_s=60, commands=["torchrun --nnodes 1:2 --rdzv-endpoint 127.0.0.2:29400 t.py"])
    assert run.rendezvous == "127.0.0.2"
    ranks = two_nodes(run)
    ranks[2].close(), ranks[3].close()
    wait_for(lambda: node_events(run), 5, "the node's event")
    for r in ranks[:2]:
        r.close()
    time.sleep(1.0)
    assert node_events(run)[0].startswith("node 127.0.0.3 lost (ranks 2-3)") and len(node_events(run)) == 1
    assert run.status == "restarting" and not run.done
    alone = [Rank(run, r, source="127.0.0.2", attempt=1, max_restarts=3, world=2) for r in range(2)]
    for r in alone:
        r.step(1)
    wait_for(lambda: run.world == 2 and run.ranks()[0].step == 1, 5, "the world-2 attempt")
    for r in alone:  # their agent ends them to admit the returning node: no end message, no node lost
        r.close()
    time.sleep(1.0)
    assert run.status != "failed" and len(node_events(run)) == 1, run.message
    back = [Rank(run, r, source=f"127.0.0.{2 + r // 2}", attempt=1, max_restarts=3, world=4) for r in range(4)]
    for r in back:
        r.step(2)
        r.send({"event": "done"})
        r.close()
    assert run.wait(10) == "finished", run.message


@pytest.mark.parametrize("given, commands, host", [
    (None, ["A=1 torchrun --rdzv-endpoint 10.0.0.1:29400 x.py"], "10.0.0.1"),
    (None, ["torchrun --rdzv_endpoint=node7:1 x.py"], "node7"), ("[fd00::1]:29400", [], "fd00::1"),
    ("10.0.0.2", ["torchrun --rdzv-endpoint 10.0.0.1:1 x.py"], "10.0.0.2"), (None, ["torchrun x.py"], None),
    (None, ["torchrun --rdzv-endpoint HOST:29400 x.py"], None), (None, ['--rdzv-endpoint "$RDZV_HOST:1"'], None)])
def test_the_rendezvous_host_is_read_from_the_argument_or_the_command(given, commands, host):
    assert rendezvous_host(given, commands) == host


def test_a_restart_that_never_comes_fails_the_run(runs):
    run = runs(restart_wait_s=0.5)
    ranks = [Rank(run, r, attempt=0, max_restarts=3, world=2) for r in range(2)]
    for r in ranks:
        r.send({"event": "error", "error": "ValueError: bad batch", "traceback": "tb"})
        r.close()
    assert run.wait(10) == "failed"
    assert "no restart came within 0 s (0 of 3 restart(s) made)" in run.message
    assert run.error["error"] == "ValueError: bad batch"


def test_a_peer_without_the_token_gets_nothing_and_changes_nothing(runs):
    run = runs()
    host, port = run.address.rsplit(":", 1)
    peer = socket.create_connection((host, int(port)))
    peer.sendall(b'{"token": "guess", "rank": 0}\n{"step": 0, "loss": 9.0}\n')
    peer.settimeout(5)
    assert peer.recv(1024) == b""  # closed, and nothing was sent to it
    assert run._server.rejected == 1
    assert run.status == "starting" and run.metrics == [] and not run.ranks()[0].connected
    peer.close()


def test_stop_detaches(runs):
    run = runs()
    Rank(run, 0).step(0)
    assert run.stop() == "stopped" and run.done
    assert "detached by the user" in run.message


def test_bad_addresses_are_refused_with_what_to_pass():
    with pytest.raises(LaunchError, match="needs host="):
        check_host(None, None)
    with pytest.raises(LaunchError, match="advertise="):
        check_host("0.0.0.0", None)
    assert check_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    with pytest.raises(LaunchError, match="cannot listen on 192.0.2.77"):  # TEST-NET-1: not an address of ours
        attach("train.py", 2, host="192.0.2.77")


# the dashboard's front end, rendered from an attached run's traits in chromium (no JupyterLab: a stub model)
PAGE = """async ([esm, state]) => {
  const mod = await import(URL.createObjectURL(new Blob([esm], {type: "text/javascript"})));
  const el = document.createElement("div");
  document.body.append(el);
  mod.default.render({model: {get: (k) => state[k], on: () => {}, send: () => {}}, el});
  await new Promise((r) => setTimeout(r, 200));
  const data = el.querySelector(".apd-data");
  return {states: [...el.querySelectorAll("tr[data-rank]")].map((tr) => tr.dataset.state),
          data: data ? data.textContent : null, warn: data ? data.classList.contains("apd-note-warn") : null,
          text: el.textContent};
}"""


@pytest.mark.browser
def test_the_dashboard_shows_a_lost_rank_and_the_data_verdict(runs):
    """Issue 15 point 6 and issue 18 point 2 in the front end: the lost rank's state, where the ranks stream to, and
    the data-wait verdict in the end summary (a warning above 10 %)."""
    import test_browser

    test_browser._require_chromium()
    run = runs()
    a, b = Rank(run, 0), Rank(run, 1)
    a.step(0), b.step(0)
    b.close()
    text = "data loading is the bottleneck: a rank waited 40% of its step time for batches; try more workers"
    a.send({"event": "data", "data_wait_share": 0.4, "bottleneck": True, "message": text})
    a.send({"event": "done"})
    assert run.wait(10) == "failed"
    board = run.dashboard()
    state = {k: getattr(board, k) for k in ("status", "message", "error", "hang", "ranks", "info", "summary")}
    state.update(timeline={}, steps={}, events=[], replan={})
    seen, errors = test_browser.evaluate_in_blank_page(PAGE, [board._esm, state])
    a.close()
    assert not errors, errors
    assert seen["states"] == ["finished", "lost"]
    assert seen["data"] == text and seen["warn"] is True
    assert f"on other hosts, streaming to {run.address}" in seen["text"]
