"""Past one machine: the exported script as 2 nodes x 2 processes in network namespaces (TP inside a node, FSDP
across nodes; pipeline stages on different nodes) with the losses of the single-process reference; a node lost and
regained under ``torchrun --nnodes 1:2 --max-restarts`` (the survivor goes on at half the world from the last DCP
checkpoint, the returning node rejoins, and every step's loss continues the reference's); the launch commands the
script prints for every plan shape; metrics that cannot reach the notebook do not stop a worker.

The namespace tests need root (``ip netns``); they make their own two namespaces (tests/netns.py), keep all traffic
between them, and remove them afterwards.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns import (
    MetricsSink,
    in_namespace,
    kill_namespace_processes,
    kill_tree,
    link_bytes,
    node_argv,
    two_nodes,
    unavailable,
)
from runtime_cases import make_plan
from test_export import CELL, SRC, TP

from autopar_nb.export import export, launch_text, layout, torchrun_commands
from autopar_nb.launch import attach
from autopar_nb.runtime.mesh import too_many_processes
from autopar_nb.source import ModelSource
from autopar_nb.verify import FP32_RTOL, reference

ROOT = Path(__file__).resolve().parents[1]
PORT = 29400  # the rendezvous port on the first node: free, as every run has namespaces of its own

NODE_PLANS = {  # 2 nodes x 2 processes; ranks 0-1 on the first node, 2-3 on the second
    "tp_in_node_fsdp_across": make_plan(SRC, dp=2, tp=2, zero=3, tp_styles=TP, loss_parallel=True),
    "pp_across_tp_in_node": make_plan(SRC, pp=2, tp=2, tp_styles=TP, schedule="1f1b", micro_batches=2,
                                      stages={"blocks.1": 1}),
}
STEPS = 3


@pytest.fixture(scope="module")
def nodes():
    why = unavailable()
    if why:
        pytest.skip(why)
    with two_nodes() as pair:
        yield pair


def run_nodes(command: str, nodes, script_dir: Path, *args: str, env: dict, timeout: float = 240):
    """Start the command on both nodes at once; returns each node's (returncode, output)."""
    logs = [script_dir / f"node{i}.log" for i in range(len(nodes))]
    procs = []
    try:
        for i, node in enumerate(nodes):
            with open(logs[i], "w") as log:
                argv = node_argv(command, i, nodes, script_dir=script_dir, port=PORT) + list(args)
                procs.append(node.popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=script_dir))
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    return [(code, log.read_text(errors="replace")) for code, log in zip(codes, logs, strict=True)]


def base_env(**extra: str) -> dict:
    return dict(os.environ, PYTHONWARNINGS="ignore", **extra)


# ---- the commands the script prints ----------------------------------------------------------------------------------

def _cluster_plan(dp, tp=1, pp=1, zero=3, *, gpus_per_node, preset="h100-80gb"):
    world = dp * tp * pp
    plan = make_plan(SRC, dp=dp, tp=tp, pp=pp, zero=zero, tp_styles=TP if tp > 1 else None,
                     stages={"blocks.1": 1} if pp > 1 else None, micro_batches=pp)
    plan.cluster = {"preset": preset, "nodes": max(1, world // gpus_per_node), "gpus_per_node": gpus_per_node}
    return plan


def test_launch_commands_fit_the_nodes():
    """One node only when the world fits one node's GPUs; otherwise nodes x gpus_per_node with c10d rendezvous; an
    elastic form when the plan can change its data-parallel degree; the script's docstring holds exactly these."""
    one = _cluster_plan(4, tp=2, gpus_per_node=8)  # 8 processes on an 8-GPU node
    assert layout(one).nodes == 1
    cmds = torchrun_commands("train.py", one)
    assert cmds[0] == "torchrun --nproc-per-node 8 train.py"
    assert cmds[1].startswith("torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d")  # the same on 2 nodes
    assert cmds[2].startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 4 "
                              "--max-restarts 3")

    big = _cluster_plan(8, tp=2, gpus_per_node=8)  # 16 processes: 2 nodes of 8, never 16 on one node
    cmds = torchrun_commands("train.py", big)
    assert not any("--nproc-per-node 16" in c for c in cmds)
    assert cmds[0] == ("torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
                       "--rdzv-id train train.py")
    assert "--nnodes 1:2 --nproc-per-node 8" in cmds[1]

    pp_tp = _cluster_plan(2, tp=4, pp=4, gpus_per_node=8)  # 32: a replica spans pp * tp = 16 ranks, 2 nodes
    cmds = torchrun_commands("train.py", pp_tp)
    assert cmds[0].startswith("torchrun --nnodes 4 --nproc-per-node 8 ")
    assert "--nnodes 2:4 " in cmds[1]  # never fewer nodes than one model replica needs

    # ZeRO-1 keeps its states in DCP as FSDP does: elastic too
    assert len(torchrun_commands("train.py", _cluster_plan(16, zero=1, gpus_per_node=8))) == 2

    odd = make_plan(SRC, dp=12)
    odd.cluster = {"preset": "h100-80gb", "gpus_per_node": 8}  # 12 processes, nodes of 8 GPUs: 2 nodes of 6
    assert layout(odd).nodes == 2 and layout(odd).per_node == 6

    cpu = make_plan(SRC, dp=2)  # no cluster: one node, or the same split over 2 nodes
    assert torchrun_commands("train.py", cpu)[:2] == [
        "torchrun --nproc-per-node 2 train.py",
        "torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id train "
        "train.py"]

    text = launch_text("train.py", big)
    assert "16 processes do not fit one node of 8 GPUs" in text and "One node" not in text
    assert all(len(line) <= 120 for line in text.splitlines())
    for command in torchrun_commands("train.py", big):
        assert " ".join(command.split()) in " ".join(text.replace("\\\n", " ").split())


def test_exported_docstring_holds_the_commands_and_passes_ruff(tmp_path):
    plan = _cluster_plan(8, tp=2, gpus_per_node=8)
    exported = export(SRC, plan, tmp_path / "train_big.py", quiet=True)
    doc = exported.script.read_text().split('"""')[1]
    for command in exported.commands:
        assert " ".join(command.split()) in " ".join(doc.replace("\\\n", " ").split())
    assert "--nproc-per-node 16" not in doc
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "pyproject.toml"),
                           str(exported.script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_too_many_processes_for_the_gpus_says_what_to_run():
    """The script's start-up check (GPUs only): 16 processes on an 8-GPU node."""
    msg = too_many_processes(16, 8, 16, "train.py")
    assert msg.startswith("torchrun started 16 processes on a node with 8 GPU(s). Run the 16 processes as 2 nodes x 8")
    assert "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py" in msg
    assert "as 2 nodes x 6" in too_many_processes(12, 8, 12, "train.py")


# ---- metrics from far away -------------------------------------------------------------------------------------------

def test_unreachable_metrics_address_does_not_stop_the_worker(monkeypatch, capsys):
    """A worker on a host that cannot reach the notebook: the Metrics client says so once and trains on."""
    import socket

    from autopar_nb.runtime.metrics import Metrics

    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed below: nothing listens there
    monkeypatch.setenv("AUTOPAR_METRICS", f"127.0.0.1:{port}")
    monkeypatch.setenv("AUTOPAR_TOKEN", "t0k")
    metrics = Metrics(3)
    assert metrics.sock is None
    metrics.send({"step": 0, "loss": 1.0})  # a no-op
    assert f"cannot reach AUTOPAR_METRICS=127.0.0.1:{port}" in capsys.readouterr().out
    monkeypatch.setenv("AUTOPAR_METRICS", "not-an-address")
    assert Metrics(0).sock is None


# ---- two nodes -------------------------------------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(NODE_PLANS))
def test_two_nodes_match_the_single_process_reference(nodes, tmp_path, name):
    """2 nodes x 2 processes, each node a network namespace running the docstring's multi-node command: the losses
    of every step equal the single-process reference's, and every rank streamed to the notebook's address."""
    plan = NODE_PLANS[name]
    script = export(SRC, plan, tmp_path / f"train_{name}.py", steps=STEPS, quiet=True).script
    command = torchrun_commands(script.name, plan, nodes=2)[1]
    assert "--nnodes 2 --nproc-per-node 2 " in command
    sink = MetricsSink(nodes[0], nodes[0].addr)
    before = [link_bytes(n) for n in nodes]
    try:
        t0 = time.perf_counter()
        results = run_nodes(command, nodes, tmp_path, env=base_env(AUTOPAR_METRICS=sink.address, AUTOPAR_TOKEN="t"))
        elapsed = time.perf_counter() - t0
    finally:
        sink.close()
    crossed = [link_bytes(n) - b for n, b in zip(nodes, before, strict=True)]
    for rc, out in results:
        assert rc == 0, out[-6000:]
    expected = reference(SRC, plan, steps=STEPS)["losses"]
    assert [r["loss"] for r in sink.steps(0)] == pytest.approx(expected, rel=FP32_RTOL, abs=0)
    assert sorted(c[0]["rank"] for c in sink.connections) == [0, 1, 2, 3]  # from both nodes
    assert min(crossed) > 50_000  # the nodes' collectives went over the pair (the model: 23k parameters)
    print(f"{name}: 2 nodes x 2 processes, {STEPS} steps in {elapsed:.1f} s, {crossed} bytes received per node")


# ---- node loss -------------------------------------------------------------------------------------------------------

# every data-parallel rank gets the same batch, so a step's loss and gradients are the same at any data-parallel
# degree: the run must follow the reference through every shrink and regrow; the test holds a step at a gate
GATED = CELL.replace("import torch\n", "import os\nimport time\n\nimport torch\n", 1) + '''

def make_batch(step, rank):
    gate = os.path.join(os.environ.get("GATE_DIR", "/nonexistent"), f"step{step}_world{os.environ.get('WORLD_SIZE')}")
    if os.path.exists(gate + ".hold"):
        open(f"{gate}.reached{rank}", "w").close()
        while not os.path.exists(gate + ".go"):
            time.sleep(0.05)
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 96, (4, 16), generator=g),)


def loss_fn(model, batch):
    logits = model(batch[0])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[0].roll(-1, 1).flatten())
'''


def _wait_for(path: Path, procs, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args[-8:]} ended ({p.returncode}) before {path.name}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear in {timeout_s} s")
        time.sleep(0.05)


@pytest.mark.multiprocess
def test_node_loss_shrinks_resumes_and_rejoins(nodes, tmp_path):
    """Elastic: 2 nodes train; the second node dies (every process in its namespace killed) at step 3; the first
    re-rendezvouses alone (world 1) and resumes from the step-3 checkpoint, resharded; at step 5 the second node comes
    back, both restart at world 2 from the step-5 checkpoint and finish. Every step's loss equals the reference's
    (each loss once, from the world that completed it). The notebook (on the first node) follows it all through an
    attached run: "restarting" after the loss, the second rank out of the world-1 attempt, both again in the last,
    "finished" with every step once. The second node's first start cannot reach the metrics address it was given
    (127.0.0.1: its own namespace's, where nothing listens): it says so and trains on."""
    src = ModelSource(GATED, loss_fn_var="loss_fn", make_batch_var="make_batch")
    plan = make_plan(src, dp=2, zero=3)
    steps = 8
    script = export(src, plan, tmp_path / "train_elastic.py", steps=steps, quiet=True).script
    elastic = torchrun_commands(script.name, plan)[2]
    assert elastic.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 1 "
                              "--max-restarts 3")
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "step3_world2.hold").touch()
    (gate / "step5_world1.hold").touch()
    run = in_namespace(nodes[0], lambda: attach(script, 2, steps, host=nodes[0].addr, plan=plan, lost_after_s=150,
                                                restart_wait_s=150))
    env = base_env(GATE_DIR=str(gate), **run.env)
    unreachable = {**env, "AUTOPAR_METRICS": "127.0.0.1:9"}
    args = ["--ckpt-every", "1"]  # the command ends in --ckpt-dir ckpt (relative to the script's directory)
    logs = {k: open(tmp_path / f"{k}.log", "w") for k in ("a", "b1", "b2")}

    def start(i, log):
        return nodes[i].popen(node_argv(elastic, i, nodes, script_dir=tmp_path, port=PORT) + args,
                              env=unreachable if log == "b1" else env, stdout=logs[log],
                              stderr=subprocess.STDOUT, cwd=tmp_path)

    procs = []
    try:
        t0 = time.perf_counter()
        procs = [start(0, "a"), start(1, "b1")]
        _wait_for(gate / "step3_world2.reached0", procs)
        _wait_for(gate / "step3_world2.reached1", procs)
        assert (tmp_path / "ckpt" / "step_3" / "manifest.json").exists()
        kill_namespace_processes(nodes[1])  # the node is gone: its agent and its worker
        procs[1].wait()
        t_lost = time.perf_counter()
        (gate / "step3_world2.go").touch()
        _wait_for(gate / "step5_world1.reached0", procs[:1])  # the survivor trained steps 3-4 alone
        t_alone = time.perf_counter()
        assert run.status == "running" and run.world == 1, run.message  # the survivor's attempt alone
        procs.append(start(1, "b2"))
        assert procs[0].wait(timeout=180) == 0 and procs[2].wait(timeout=60) == 0
        t_end = time.perf_counter()
        assert run.wait(30) == "finished", run.message
    finally:
        for p in procs:
            kill_tree(p)
        for f in logs.values():
            f.close()
        run.stop()
    a, b1 = (tmp_path / "a.log").read_text(), (tmp_path / "b1.log").read_text()
    assert "failed (exitcode: 1)" in a and "10.231.0.2" in a, a[-4000:]  # the collective with the lost node failed
    shrunk, regrown = a.index("resumed from ckpt/step_3 at step 3"), a.index("resumed from ckpt/step_5 at step 5")
    assert a.count("1 processes, not the plan's 2: dp(1), not dp(2)") == 1  # once: at world 1
    assert shrunk > a.index("dp(1), not dp(2)") > a.index("failed (exitcode: 1)") and regrown > shrunk
    assert "cannot reach AUTOPAR_METRICS=127.0.0.1:9" in b1  # that node trained without the dashboard
    records = [r for r in run.metrics if r["rank"] == 0]
    assert [r["step"] for r in records] == list(range(steps))  # 0-2 at world 2, 3-4 at world 1, 5-7 at world 2
    assert [r["attempt"] for r in records] == [0, 0, 0, 1, 1, 2, 2, 2]
    assert [r["step"] for r in run.metrics if r["rank"] == 1] == [5, 6, 7]  # its first start never streamed
    assert run.world == 2 and [st.state(run.status) for st in run.ranks().values()] == ["finished", "finished"]
    expected = reference(src, plan, steps=steps)["losses"]
    assert [r["loss"] for r in records] == pytest.approx(expected, rel=FP32_RTOL, abs=0)
    print(f"node lost at {t_lost - t0:.1f} s; alone until {t_alone - t0:.1f} s; rejoined, done at {t_end - t0:.1f} s")


# ---- the dashboard attached to a run on another host -------------------------------------------------------------

@pytest.mark.multiprocess
def test_attached_run_follows_torchrun_on_another_node(nodes, tmp_path):
    """The notebook on the first node (its metrics server bound to the first node's address on the pair), the
    exported script under torchrun (2 processes) on the second, started with the command ``ap.attach`` prints: the
    attached run, which has no local process, sees every rank's every step and its end, and reaches "finished". A peer
    on the second node without the token is closed and changes nothing."""
    plan = make_plan(SRC, dp=2, zero=3)
    steps = 4
    exported = export(SRC, plan, tmp_path / "train_attached.py", steps=steps, quiet=True)
    run = in_namespace(nodes[0], lambda: attach(exported.script, 2, steps, host=nodes[0].addr, plan=plan,
                                                commands=exported.commands, lost_after_s=120))
    proc = None
    try:
        assert run.address.startswith(f"{nodes[0].addr}:") and run.backend == "gloo"
        words = shlex.split(run.commands[0])
        assert words[:2] == [f"AUTOPAR_METRICS={run.address}", f"AUTOPAR_TOKEN={run.env['AUTOPAR_TOKEN']}"]
        assert words[2:] == ["torchrun", "--nproc-per-node", "2", exported.script.name]
        host, port = run.address.split(":")
        peer = (f"import socket; s = socket.create_connection(({host!r}, {port})); "
                "s.sendall(b'{\"token\": \"x\", \"rank\": 0}\\n{\"step\": 0}\\n'); s.settimeout(15); "
                "print(repr(s.recv(100)))")
        probe = subprocess.run(nodes[1].argv([sys.executable, "-c", peer]), capture_output=True, text=True,
                               timeout=60)
        assert probe.stdout.strip() == "b''", probe.stderr  # closed; nothing was sent to it
        env = base_env(**dict(w.split("=", 1) for w in words[:2]))
        argv = [sys.executable, "-m", "torch.distributed.run", *words[3:-1], str(exported.script)]
        with open(tmp_path / "node1.log", "w") as log:
            proc = nodes[1].popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
            assert proc.wait(timeout=240) == 0, (tmp_path / "node1.log").read_text()[-4000:]
        assert run.wait(30) == "finished", run.message
    finally:
        if proc is not None:
            kill_tree(proc)
        run.stop()
    assert run._server.rejected == 1 and run.processes() == []
    for rank in (0, 1):
        assert run.metrics.column("step", rank) == list(range(steps))
        assert run.ranks()[rank].state(run.status) == "finished"
    assert run.message.startswith(f"finished {steps} steps")
    assert {s["source"] for s in run.samples if s["state"] == "running"} <= {"stream", None}


def _kill_the_agent_once_printed(script, marker: str, tmp_path) -> None:
    """Start ``script`` under a real torchrun (one worker), SIGKILL torchrun alone once the log shows ``marker``,
    and require its worker (in a session of its own, not the agent's group) gone within 10 s."""
    import psutil

    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(script)]
    with open(tmp_path / "torchrun.log", "w") as log:
        agent = subprocess.Popen(argv, env=base_env(), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                 start_new_session=True)
    workers = []
    try:
        deadline = time.time() + 180
        while marker not in (tmp_path / "torchrun.log").read_text(errors="replace"):
            assert agent.poll() is None and time.time() < deadline, (tmp_path / "torchrun.log").read_text()
            time.sleep(0.5)
        workers = psutil.Process(agent.pid).children()
        assert len(workers) == 1, workers
        agent.kill()
        agent.wait()
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"the worker (pid {workers[0].pid}) outlived its torchrun"
    finally:
        kill_tree(agent)
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()


@pytest.mark.multiprocess
def test_a_worker_dies_with_its_torchrun_killed_while_it_imports(tmp_path):
    """SIGKILL to torchrun while its worker still imports (torch's import takes seconds on a loaded host, before
    init_distributed): the exported script's first lines, which the worker here runs before sleeping in place of
    the imports, set the death signal already, so the worker ends with its agent."""
    from autopar_nb.export import kit

    script = tmp_path / "importing.py"
    script.write_text("\n\n".join(kit.with_early(set())) + "\n\nimport time\n\nprint('importing', flush=True)\n"
                      "time.sleep(600)\n")
    _kill_the_agent_once_printed(script, "importing", tmp_path)


@pytest.mark.multiprocess
def test_a_worker_dies_with_its_killed_torchrun(tmp_path):
    """SIGKILL to torchrun alone (a killed job step, an OOM-killed agent): torchrun starts its workers in sessions of
    their own with no death signal, so the worker trained on as an orphan (on several nodes, with the other nodes:
    nothing restarted the group). The exported script sets one: the worker ends with its agent."""
    script = export(SRC, make_plan(SRC, dp=1), tmp_path / "train.py", steps=100_000, quiet=True).script
    _kill_the_agent_once_printed(script, "step 2 ", tmp_path)
