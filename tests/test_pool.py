"""The warm pool (autopar_nb/launch/pool.py): what runs warm is what torchrun runs, and the pool's processes come and
go with the kernel."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from autopar_nb.launch import launch, live_runs
from autopar_nb.launch import pool as pool_mod
from autopar_nb.launch.channel import MetricsServer
from autopar_nb.launch.pool import (
    POOL,
    Pool,
    importable_here,
    imports_of,
    job_env,
    lazily_loaded,
    script_preload,
    shadowed,
    verify_preload,
)
from autopar_nb.launch.procs import processes_with_token, rank_of

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parent.parent


def wait_for(cond, timeout: float, what: str, poll: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(autouse=True)
def _no_leftover_runs():
    yield
    for r in live_runs():
        r.stop("test cleanup")


# ---- without processes --------------------------------------------------------------------------------------------
def test_preload_takes_installed_modules_only(tmp_path):
    code = "import torch, json\nimport torch.nn.functional as F\nfrom torch.distributed import tensor\n" \
           "from . import sibling\nimport mylocal\n\ndef f():\n    from torch.distributed.tensor import DTensor\n"
    assert imports_of(code) == {"torch", "json", "torch.nn.functional", "torch.distributed",
                                "torch.distributed.tensor", "mylocal"}
    (tmp_path / "mylocal.py").write_text("X = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import mylocal  # noqa: F401  (imported here, from a user's directory: never preloaded)

        assert importable_here(imports_of(code)) == ["json", "torch", "torch.distributed", "torch.distributed.tensor",
                                                     "torch.nn.functional"]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("mylocal", None)
    script = tmp_path / "train.py"
    script.write_text(code)
    assert set(pool_mod.BASE_PRELOAD) <= set(script_preload(script)) and "mylocal" not in script_preload(script)
    # a script whose directory has its own `json` would import it, not the preloaded one: that standby is not used
    assert shadowed(script_preload(script), tmp_path) == []
    (tmp_path / "json.py").write_text("")
    assert shadowed(script_preload(script), tmp_path) == ["json"]
    v = verify_preload("import torch\nfrom autopar_nb.zoo import GPT\n")
    assert "autopar_nb.verify.ranks" in v and "torch.distributed.tensor.parallel" in v and "torch.distributed.fsdp" in v
    # a verify's ranks run in the kernel's folder: its own autopar_nb shadows the preloaded one, unless it is the
    # one this process imported (a checkout's root)
    import autopar_nb

    assert shadowed(v, Path(autopar_nb.__file__).parent.parent) == []
    (tmp_path / "autopar_nb").mkdir()
    (tmp_path / "autopar_nb" / "__init__.py").write_text("")
    assert shadowed(v, tmp_path) == ["autopar_nb"]
    # what a job's standby must match: pytest's per-test variable and the run's own token/channel never count
    assert job_env({"PYTEST_CURRENT_TEST": "t.py::a (call)", "AUTOPAR_TOKEN": "x", "AUTOPAR_METRICS": "h:1",
                    "A": "1"}) == {"A": "1"}


def test_rank_of_a_forked_worker_is_read_from_its_log(tmp_path):
    """A warm worker's /proc environ is its forkserver's (no RANK): its rank is the log torch points its stdout at."""
    log = tmp_path / "logs" / "run_x" / "attempt_0" / "1" / "stdout.log"
    log.parent.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=out, env=env)
    try:
        assert rank_of(psutil.Process(proc.pid)) == 1
        assert rank_of(psutil.Process()) is None or "RANK" in os.environ
    finally:
        proc.kill()
        proc.wait()


# ---- real runs ----------------------------------------------------------------------------------------------------
def _views(tmp_path, warm: bool) -> list[dict]:
    out = tmp_path / ("warm" if warm else "cold")
    out.mkdir()
    run = launch(FIXTURES / "env_view.py", nproc=2, steps=None, out=str(out), warm=warm, run_dir=out / "run")
    assert run.wait(120) == "finished", f"{run.message}\n{run.logs(0)}"
    assert run.warm is warm
    return [json.loads((out / f"view_{r}.json").read_text()) for r in (0, 1)]


RUN_SPECIFIC = ("AUTOPAR_METRICS", "AUTOPAR_TOKEN", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")


@pytest.mark.multiprocess
def test_a_warm_rank_sees_what_a_torchrun_rank_sees(tmp_path, monkeypatch):
    """The same script under launch(warm=True) and launch(warm=False) (the agent's torchrun config, `python -u
    script.py` per rank): __name__, __file__, sys.argv, the working directory (the kernel's, not the script's: as
    `torchrun /abs/script.py` run from the notebook's folder), sys.path (the script's directory first), the
    environment (run ids, ports and paths aside), signal handlers; nothing of the kernel (autopar_nb, IPython,
    pytest) in the warm rank, and no CUDA state forked into it."""
    kernel_cwd = tmp_path / "notebook"
    kernel_cwd.mkdir()
    monkeypatch.chdir(kernel_cwd)
    cold, warm = _views(tmp_path, False), _views(tmp_path, True)
    for rank, (c, w) in enumerate(zip(cold, warm, strict=True)):
        assert w["name"] == c["name"] == "__main__" and w["main_is_this"] and c["main_is_this"]
        assert w["file"] == c["file"] == str(FIXTURES / "env_view.py")
        assert [a for a in w["argv"] if "/warm" not in a] == [a for a in c["argv"] if "/cold" not in a]
        assert w["cwd"] == c["cwd"] == str(kernel_cwd)
        assert w["path"] == c["path"] and w["path"][0] == str(FIXTURES)
        same = {k: v for k, v in c["env"].items() if k not in RUN_SPECIFIC}
        assert {k: v for k, v in w["env"].items() if k not in RUN_SPECIFIC} == same
        assert set(RUN_SPECIFIC) <= set(w["env"]) and w["env"]["RANK"] == str(rank)
        assert w["env"]["OMP_NUM_THREADS"] == "1" and "PYTEST_CURRENT_TEST" not in w["env"]
        assert (w["sigint"], w["sigterm"]) == (c["sigint"], c["sigterm"])
        assert w["modules"] == c["modules"] == []
        assert not w["cuda_initialized"] and not w["bad_fork"]
        assert w["threads"] == c["threads"] == 1 and w["all_reduce"] == c["all_reduce"] == 3.0


def _torchrun_losses(script: Path, steps: int) -> dict[int, list[tuple[int, float]]]:
    """rank -> [(step, loss)] of `python -m torch.distributed.run --standalone` on the script, from its metrics."""
    server = MetricsServer()
    env = {**os.environ, "AUTOPAR_METRICS": server.address, "AUTOPAR_TOKEN": server.token, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script), "--steps", str(steps)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, cwd=script.parent)
    losses: dict[int, list] = {0: [], 1: []}
    try:
        while proc.poll() is None:
            for m in server.poll(0.05):
                if m.kind == "data" and isinstance(m.data.get("step"), int):
                    losses[m.rank].append((m.data["step"], m.data["loss"]))
        for m in server.poll(0.2):
            if m.kind == "data" and isinstance(m.data.get("step"), int):
                losses[m.rank].append((m.data["step"], m.data["loss"]))
        assert proc.returncode == 0, proc.stderr.read().decode()[-3000:]
    finally:
        proc.kill()
        server.close()
    return losses


@pytest.mark.multiprocess
def test_warm_launch_and_torchrun_give_identical_losses(tmp_path):
    """Issue 19's guarantee: a warm launch runs the exported script itself (the run directory's train.py, byte for
    byte), so its per-step losses equal torchrun's run of the same file, exactly."""
    export = pytest.importorskip("autopar_nb.export").export
    from runtime_cases import make_plan

    from autopar_nb.demo import QUICKSTART_CELL
    from autopar_nb.source import ModelSource

    src = ModelSource(QUICKSTART_CELL)
    plan = make_plan(src, tp=2, tp_styles={"linear1": "colwise", "linear2": "rowwise"})  # the seed MLP's plan
    run = launch(lambda path: export(src, plan, path, steps=5, quiet=True), nproc=2, steps=5, plan=plan,
                 run_dir=tmp_path / "run")
    assert run.wait(120) == "finished", f"{run.message}\n{run.logs(0)}"
    assert run.warm and "--run-path" in run.command and str(run.script) in run.command
    copy = tmp_path / "torchrun" / "train.py"
    copy.parent.mkdir()
    for name in ("train.py", "train_runtime.py"):  # the script and the runtime module it imports
        (copy.parent / name).write_bytes(run.script.with_name(name).read_bytes())
    ref = _torchrun_losses(copy, 5)
    for rank in (0, 1):
        assert run.loss_curve(rank) == sorted(ref[rank]) and len(ref[rank]) == 5


@pytest.mark.multiprocess
def test_the_pool_is_reused_replaced_when_dead_and_quits_when_idle(tmp_path):
    """A run ends -> one standby starts; the next run takes it (its agent is that process); a standby killed while
    waiting, or whose forkserver was killed, is replaced without the user noticing; an idle standby quits."""
    script = FIXTURES / "train_fixture.py"
    POOL.close()
    first = launch(script, nproc=2, steps=2, run_dir=tmp_path / "a")
    assert first.wait(120) == "finished", first.message
    standby = POOL.waiting("launch")
    assert standby is not None and POOL.wait_ready("launch", 120)
    started = POOL.started
    second = launch(script, nproc=2, steps=2, run_dir=tmp_path / "b")
    assert second._proc is standby.proc and second._token == standby.token  # its agent was the standby
    assert second.wait(120) == "finished", second.message
    assert POOL.started == started + 1  # the refill, nothing else
    assert not processes_with_token(second._token)  # its forkserver too

    # a standby that died while waiting: the next launch starts another, transparently
    assert POOL.wait_ready("launch", 120)
    dead = POOL.waiting("launch").proc
    dead.kill()
    dead.wait()
    third = launch(script, nproc=2, steps=2, run_dir=tmp_path / "c")
    assert third.wait(120) == "finished", third.message

    # a standby whose forkserver died: multiprocessing starts the forkserver again for the ranks
    assert POOL.wait_ready("launch", 120)
    waiting = POOL.waiting("launch")
    forkserver = [p for p in psutil.Process(waiting.proc.pid).children() if "forkserver" in " ".join(p.cmdline())]
    assert len(forkserver) == 1
    forkserver[0].kill()
    fourth = launch(script, nproc=2, steps=2, run_dir=tmp_path / "d")
    assert fourth.wait(120) == "finished", fourth.message
    assert fourth._proc is waiting.proc

    # idle: a standby quits after its idle timeout (AUTOPAR_POOL_IDLE_S, read when it starts), with its forkserver
    idle = Pool()
    os.environ["AUTOPAR_POOL_IDLE_S"] = "1"
    try:
        idle.refill("launch", env=dict(os.environ), monitor=False, preload=["json"])
    finally:
        del os.environ["AUTOPAR_POOL_IDLE_S"]
    s = idle.waiting("launch")
    assert s is not None and "1.0" in s.proc.args
    wait_for(lambda: not s.alive(), 60, "the idle standby to quit")
    wait_for(lambda: not processes_with_token(s.token), 10, "its forkserver to quit (ended by the standby)")
    idle._cleanup()  # its log folder too


KERNEL = textwrap.dedent("""
    import sys, time
    from autopar_nb.launch import launch
    from autopar_nb.launch.pool import POOL
    run = launch(sys.argv[1], nproc=2, steps=2)
    run.wait(120)
    POOL.wait_ready("launch", 120)
    print(run.status, POOL.waiting("launch").token, flush=True)
    time.sleep(600)          # the test SIGKILLs this "kernel"
""")


@pytest.mark.multiprocess
def test_the_pool_dies_with_the_kernel():
    """A kernel killed outright leaves no standby, forkserver or resource tracker behind."""
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, str(FIXTURES / "train_fixture.py")],
                              stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = kernel.stdout.readline().split()
        assert line[:1] == ["finished"] and re.fullmatch(r"[0-9a-f]{32}", line[1]), line
        token = line[1]
        names = [" ".join(p.cmdline()) for p in processes_with_token(token)]
        assert any("--standby" in n for n in names) and any("forkserver" in n for n in names), names
        kernel.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: not processes_with_token(token), 5, "the pool to end")
        assert time.monotonic() - t0 < 5
        kernel.wait()
        # its log folder stays (no exit clean-up ran) until a pool starts: then it goes
        left = [d for d in Path(tempfile.gettempdir()).glob("autopar-pool-*")
                if (d / pool_mod.OWNER_FILE).exists() and
                json.loads((d / pool_mod.OWNER_FILE).read_text())["pid"] == kernel.pid]
        assert len(left) == 1 and list(left[0].glob("launch-*.log"))
        assert left[0] in pool_mod.remove_stale_folders() and not left[0].exists()
    finally:
        kernel.kill()
        kernel.wait()


@pytest.mark.multiprocess
def test_warm_verify_equals_cold_verify_and_the_reference_may_run_beside(monkeypatch):
    """verify_many warm (ranks forked in a standby, reference there) and cold (ranks spawned from here, the
    reference in a thread beside them, as when a core is left over) give the same report: the same parallel run,
    and references that differ only by the threads they ran on (the warm one uses every core, one thread beside)."""
    import importlib

    from runtime_cases import GPT_CELL, gpt_mlp_tp, make_plan, source


    verify_mod = importlib.import_module("autopar_nb.verify")  # the module (the package binds the function)
    check_mod = importlib.import_module("autopar_nb.verify.check")
    src = source(GPT_CELL)
    cases = [(src, make_plan(src, dp=2)), (src, make_plan(src, tp=2, tp_styles=gpt_mlp_tp()))]
    warm = verify_mod.verify_many(cases, steps=3)
    monkeypatch.setattr(check_mod, "cores", lambda: 3)
    cold = verify_mod.verify_many(cases, steps=3, warm=False)
    for w, c in zip(warm, cold, strict=True):
        assert w.ok and c.ok, f"{w}\n{c}"
        assert w.losses == c.losses and w.per_rank == c.per_rank and w.missing == c.missing == []
        assert [s.ref_loss for s in w.steps] == pytest.approx([s.ref_loss for s in c.steps], rel=1e-6)
        assert w.param_floor == pytest.approx(c.param_floor, rel=1e-6)


@pytest.mark.multiprocess
def test_a_warm_run_shorter_than_a_tick_has_its_ranks_figures(tmp_path):
    """Issue 19 leftover: warm ranks connect ~0.3 s after the call and can finish a short run before the first 1 s
    tick, so their processes were never sampled (no RSS, no CPU %). They are sampled when they say hello, and a
    process's first reading has its CPU % since it started."""
    script = FIXTURES / "train_fixture.py"
    first = launch(script, nproc=2, steps=2, run_dir=tmp_path / "a")  # starts the pool, if none waits
    assert first.wait(120) == "finished", first.message
    assert POOL.wait_ready("launch", 120)
    run = launch(script, nproc=2, steps=3, run_dir=tmp_path / "b")
    assert run.wait(60) == "finished", run.message
    for rank in (0, 1):
        last = [s for s in run.samples if s["rank"] == rank][-1]
        assert last["source"] == "psutil" and last["rss_bytes"] > 50e6, last
        assert last["utilization_pct"] is not None and last["utilization_pct"] > 0, last


def test_a_process_first_reading_has_its_cpu_since_start():
    from autopar_nb.launch.monitor import DeviceSampler

    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"])
    try:
        proc, deadline = psutil.Process(busy.pid), time.time() + 20
        while sum(proc.cpu_times()[:2]) < 0.2 and time.time() < deadline:  # it has run (on a loaded box, later)
            time.sleep(0.05)
        first = DeviceSampler(False).sample({0: psutil.Process(busy.pid)})[0]
        # psutil's own first cpu_percent() is 0.0: a reading since the start is above 0 whatever else runs
        assert first["cpu_percent"] is not None and first["cpu_percent"] > 0 and first["rss"] > 0
    finally:
        busy.kill()
        busy.wait()


def test_idle_timeout_from_the_environment(monkeypatch):
    """AUTOPAR_POOL_IDLE_S: 0 keeps no standby after a job; a bad value says what to give."""
    monkeypatch.delenv("AUTOPAR_POOL_IDLE_S", raising=False)
    assert pool_mod.idle_timeout_s() == pool_mod.IDLE_TIMEOUT_S == 300
    monkeypatch.setenv("AUTOPAR_POOL_IDLE_S", "0")
    pool = Pool()
    pool.refill("launch", env=dict(os.environ), monitor=False, preload=["json"])
    assert pool.started == 0 and pool.waiting("launch") is None  # nothing is held after the run
    for bad in ("soon", "-5", "inf", "nan"):
        monkeypatch.setenv("AUTOPAR_POOL_IDLE_S", bad)
        with pytest.raises(ValueError, match="AUTOPAR_POOL_IDLE_S=.*a number >= 0"):
            pool_mod.idle_timeout_s()


def test_stale_pool_folders_are_removed_when_a_pool_starts(tmp_path):
    """A killed kernel never runs its exit clean-up: the next pool removes the folders whose owner is gone (a PID
    reused by another process does not count as the owner), and old ones without an owner file; it keeps the live."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    me = psutil.Process()

    def folder(name, owner=None, age_s=0.0):
        d = tmp_path / name
        d.mkdir()
        (d / "launch-x.log").write_text("log")
        if owner is not None:
            (d / pool_mod.OWNER_FILE).write_text(json.dumps(owner))
        os.utime(d, (time.time() - age_s, time.time() - age_s))
        return d

    dead = folder("autopar-pool-dead", {"pid": int(done.stdout), "create_time": 1.0})
    reused = folder("autopar-pool-reused", {"pid": me.pid, "create_time": me.create_time() - 100})
    live = folder("autopar-pool-live", {"pid": me.pid, "create_time": me.create_time()})
    old = folder("autopar-pool-old", age_s=2 * pool_mod.LEGACY_STALE_S)
    recent = folder("autopar-pool-recent", age_s=60)
    other = tmp_path / "autopar-pool-file"
    other.write_text("not a folder")
    new = pool_mod.make_pool_folder(tmp_path)
    assert not dead.exists() and not reused.exists() and not old.exists()
    assert live.exists() and recent.exists() and other.exists()
    assert json.loads((new / pool_mod.OWNER_FILE).read_text())["pid"] == me.pid and pool_mod.owner_alive(new)


WIDTH_CELL = """\
import torch
import torch.nn as nn

width = int(open("width.txt").read())  # relative to the notebook's folder
model = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 4))
example_inputs = (torch.randn(8, width),)
"""


@pytest.mark.multiprocess
def test_a_warm_verify_follows_the_kernel_into_another_folder(tmp_path, monkeypatch):
    """A verify standby started while the kernel was in one folder runs a job given after the kernel moved to
    another (``os.chdir`` in a notebook) in the new one, as a cold verify and launch do: the cell's relative
    ``open("width.txt")`` holds in the ranks and the reference. (Before, the standby's ranks ran in the folder it
    was started in: FileNotFoundError.)"""
    from runtime_cases import make_plan, source

    from autopar_nb.verify.job import VerifyJob

    before, notebook = tmp_path / "before", tmp_path / "notebook"
    before.mkdir(), notebook.mkdir()
    (notebook / "width.txt").write_text("12")
    src = source(WIDTH_CELL)
    monkeypatch.chdir(notebook)
    plan = make_plan(src, dp=2)
    monkeypatch.chdir(before)  # the standby starts here, where width.txt is not
    POOL.close()
    POOL.refill("verify", env=job_env({**os.environ, "PYTHONUNBUFFERED": "1"}), monitor=True,
                preload=verify_preload(src.code))
    standby = POOL.waiting("verify")
    assert standby is not None and POOL.wait_ready("verify", 120)
    monkeypatch.chdir(notebook)
    job = VerifyJob(src, plan, steps=2, nproc=2, warm=True)
    report = job.wait(300)
    assert job._proc is standby.proc, "the waiting standby took the job"
    assert job.error is None and report is not None and report.ok, job.error or report


def test_a_standby_preloads_what_a_lazy_package_loads_on_first_access(tmp_path):
    """``from transformers import LlamaForCausalLM`` loads transformers' modelling module when the name is read, in
    every warm rank unless the forkserver read it first (launch's, verify's and the memory measurement's); a user's
    own module is never imported to find out."""
    (tmp_path / "mine.py").write_text("raise RuntimeError('imported')\n")
    code = "from transformers import LlamaForCausalLM\nfrom mine import thing\nimport torch\n"
    script = tmp_path / "train.py"
    script.write_text(code)
    modelling = "transformers.models.llama.modeling_llama"
    sys.path.insert(0, str(tmp_path))
    try:
        assert modelling in lazily_loaded(code)
        assert modelling in script_preload(script) and modelling in verify_preload(code)
        assert lazily_loaded("from transformers import (") == []  # a cell that does not parse: nothing
    finally:
        sys.path.remove(str(tmp_path))
    assert "mine" not in sys.modules


def test_a_warm_rank_finds_the_pipeline_tracer_preloaded():
    """Every pipelined rank traces its model with torch's ``pipeline()``, whose first call in a process imported 405
    modules (torch.export's tracer, aot_autograd, inductor's and networkx's parts: 0.3 of its 0.7 CPU s on a 2-layer
    LLaMA). A forkserver that imported :data:`BASE_PRELOAD` hands them to every rank it forks."""
    code = textwrap.dedent(f"""
        import importlib, json, sys
        for m in {list(pool_mod.BASE_PRELOAD)!r}:
            importlib.import_module(m)
        import torch
        from torch.distributed.pipelining import SplitPoint, pipeline
        from autopar_nb.zoo import Llama, LlamaConfig
        model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64))
        before = set(sys.modules)
        pipeline(model, mb_args=(torch.randint(0, 64, (2, 16)),), split_spec={{"layers.1": SplitPoint.BEGINNING}})
        print(json.dumps(sorted(set(sys.modules) - before)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert len(json.loads(out.strip().splitlines()[-1])) < 40, out
