import pytest
from IPython.core.error import UsageError
from test_hardware import H100_NVML_BYTES, H100_TORCH_BYTES, simulate_host

from autopar_nb.notebook.magic import AutoparallelMagics
from autopar_nb.notebook.session import Session

SEED_CELL = """
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512))
example_inputs = (torch.randn(32, 1024),)
"""

HOSTS = {"cpu-host": 0, "4xh100-host": 4}
"""the machines every test here runs on, simulated whatever this one is: CPU-only, and 4 H100s (with NVML)"""


@pytest.fixture(autouse=True, params=list(HOSTS))
def host_gpus(request, monkeypatch) -> int:
    """GPUs of the (simulated) machine the magic runs on: `--gpu auto`, the default, detects them."""
    simulate_host(monkeypatch, HOSTS[request.param], "NVIDIA H100 80GB HBM3", H100_TORCH_BYTES,
                  nvml_memory=H100_NVML_BYTES)
    return HOSTS[request.param]


def test_magic_binds_session_and_keeps_source(ip):
    session = ip.run_cell_magic("autoparallel", "--gpus 4 --gpu h100-80gb --batch 64", SEED_CELL)
    assert isinstance(session, Session) and ip.user_ns["ap"] is session
    assert session.source.code == SEED_CELL
    assert session.cluster.world_size == 4 and session.cluster.name == "h100-80gb"
    assert session.batch == 64
    assert session.graph.num_params == 1024 * 1024 + 1024 + 1024 * 512 + 512
    assert all(p.is_meta for p in ip.user_ns["model"].parameters())  # built on meta: no weights allocated
    html = session._repr_html_()
    assert "1.57 M" in html and "h100-80gb" in html and "<table>" in html


def test_options_name_fix_dtype_mode_and_host_default(ip, host_gpus):
    s = ip.run_cell_magic("autoparallel", "--name seed --fix tp=2,zero=3,mb=4 --dtype bf16 --mode semi",
                          SEED_CELL)
    assert ip.user_ns["seed"] is s and "ap" not in ip.user_ns
    assert s.fix == {"tp": 2, "zero_stage": 3, "micro_batches": 4, "amp": "bf16"}
    assert s.mode == "semi"
    if host_gpus:  # --gpu auto: this machine's GPUs, its memory as NVML reports it
        assert (s.cluster.name, s.cluster.nodes, s.cluster.gpus_per_node) == ("h100-80gb", 1, host_gpus)
        assert s.cluster.device.memory_bytes == H100_NVML_BYTES
    else:  # no GPU: 2 CPU processes, so that the plan can be launched here
        assert (s.cluster.name, s.cluster.nodes, s.cluster.gpus_per_node) == ("cpu", 1, 2)
    assert s.plan.mesh.world_size == s.cluster.world_size and s.plan.mesh.tp == 2


DEEP_CELL = """
import torch, torch.nn as nn
model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
example_inputs = (torch.randn(32, 256),)
"""
"""six layers with parameters: three pipeline stages for the odd world sizes of three nodes (the seed MLP's ReLU
holds none, so it starts no stage, and its pp stops at 2)"""


@pytest.mark.parametrize("line, gpus_per_node", [("--gpus 2", 2), ("--nodes 3", None), ("--nodes 2 --gpus 8", 8)])
def test_gpus_and_nodes_scale_the_detected_machine(ip, host_gpus, line, gpus_per_node):
    s = ip.run_cell_magic("autoparallel", line, DEEP_CELL)
    nodes = 3 if "--nodes 3" in line else 2 if "--nodes 2" in line else 1
    expected = gpus_per_node or host_gpus or 2
    assert (s.cluster.name, s.cluster.nodes, s.cluster.gpus_per_node) == (
        "h100-80gb" if host_gpus else "cpu", nodes, expected)
    assert s.plan.mesh.world_size == nodes * expected


def test_memory_sets_a_per_rank_limit_the_plan_fits_and_records(ip):
    """--memory (issue 14, point 5): the planner fits each rank under it, and the plan carries it to the launch."""
    s = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --memory 96MiB", SEED_CELL)
    # the limit in the unit its size calls for (it said "limit 0.0938 GiB per rank")
    assert s.cluster.rank_memory_bytes == 96 * 2**20 and "limit 96.0 MiB per rank" in s.cluster.describe()
    assert s.plan.cluster["memory_limit_bytes"] == 96 * 2**20
    assert s.plan.cost.peak_memory_bytes <= 96 * 2**20


def test_repeated_blocks_are_folded_in_summary(ip):
    cell = """
import torch
from autopar_nb.zoo import GPT, GPTConfig
model = GPT(GPTConfig(n_layer=6, n_head=4, n_embd=128, block_size=64, vocab_size=1000))
example_inputs = (torch.randint(0, 1000, (4, 64)),)
"""
    s = ip.run_cell_magic("autoparallel", "--gpu a100-80gb", cell)
    assert "h.[0-5]" in s.summary() and "x 6" in s.summary()
    assert "h.[0–5]" in s._repr_html_()


def test_model_and_inputs_options(ip):
    cell = SEED_CELL.replace("model =", "net =").replace("example_inputs =", "x =") + "\nhelper = nn.Linear(2, 2)\n"
    with pytest.raises(UsageError, match="several models.*helper, net.*--model"):
        ip.run_cell_magic("autoparallel", "", cell)
    s = ip.run_cell_magic("autoparallel", "--model net --inputs x", cell)
    assert s.source.model_var == "net" and s.source.inputs_var == "x"


def test_loss_fn_and_make_batch_are_found(ip):
    cell = SEED_CELL + """
def loss_fn(model, batch):
    return model(*batch).pow(2).mean()

def make_batch(step, rank):
    g = torch.Generator().manual_seed(step * 100 + rank)
    return (torch.randn(32, 1024, generator=g),)
"""
    s = ip.run_cell_magic("autoparallel", "", cell)
    assert s.source.loss_fn_var == "loss_fn" and s.source.make_batch_var == "make_batch"


@pytest.mark.parametrize("line, cell, message", [
    ("", "x = 1\n", "no model found"),
    ("", "import torch.nn as nn\nmodel = nn.Linear(2, 2)\n", "no example inputs found"),
    ("", "model = (\n", "syntax error in the cell, line 2 \\(`model = \\(`\\)"),  # line 1 is %%autoparallel's
    ("", "import torch\nmodel = torch.nn.Linear(2, 2)\nexample_inputs = torch.randn(3, 2)\n1 / 0\n",
     "the cell raised ZeroDivisionError \\(cell line 5\\)"),
    ("--model net", SEED_CELL, "defines no variable 'net'"),
    ("--inputs model", SEED_CELL, "example inputs must be a tensor"),
    ("--fix tp", SEED_CELL, "expected KEY=VALUE"),
    ("--fix color=red", SEED_CELL, "KEY one of dp, tp, pp"),
    ("--gpu p100", SEED_CELL, "--gpu: unknown GPU preset 'p100'"),
    ("--gpus 0", SEED_CELL, "must be >= 1"),
    ("--gpu cpu --memory lots", SEED_CELL, "--memory: memory size 'lots' not understood"),
    ("--name 1x", SEED_CELL, "not a valid Python variable name"),
])
def test_user_mistakes_give_one_line_and_leave_namespace(ip, line, cell, message):
    before = dict(ip.user_ns)
    with pytest.raises(UsageError, match=message) as err:
        ip.run_cell_magic("autoparallel", line, cell)
    assert "\n" not in str(err.value)
    assert set(ip.user_ns) == set(before) and all(ip.user_ns[k] is before[k] for k in before)


def test_bad_option_is_a_usage_error(ip):
    with pytest.raises(UsageError):
        ip.run_cell_magic("autoparallel", "--gpus eight", SEED_CELL)
    with pytest.raises(UsageError):
        ip.run_cell_magic("autoparallel", "--mode sometimes", SEED_CELL)


def test_untraceable_model_names_the_line(ip):
    cell = """
import torch, torch.nn as nn
class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
    def forward(self, x):
        if self.lin(x).sum() > 0:
            return x
        return -x
model = Gate()
example_inputs = torch.randn(2, 4)
"""
    with pytest.raises(UsageError, match=r"called at cell line 9: `if self.lin\(x\).sum\(\) > 0:`"):
        ip.run_cell_magic("autoparallel", "", cell)
    assert "Gate" not in ip.user_ns  # nothing half-bound


def test_names_from_earlier_cells_are_reported_and_can_be_included(ip):
    ip.run_cell("import torch, torch.nn as nn\nWIDTH = 256", store_history=True)
    cell = "model = nn.Linear(WIDTH, 8)\nexample_inputs = (torch.randn(4, WIDTH),)\n"
    with pytest.raises(UsageError, match="uses WIDTH, nn, torch from earlier cells.*--include-cells"):
        ip.run_cell_magic("autoparallel", "", cell)
    s = ip.run_cell_magic("autoparallel", "--include-cells", cell)
    assert s.source.code.startswith("import torch, torch.nn as nn\nWIDTH = 256")
    assert s.source.code.endswith(cell)
    assert s.graph.num_params == 256 * 8 + 8


def test_steps_reach_the_plan(ip):
    """--steps: the run the plan weighs compile's start-up over (10,000 without it); 0 is a one-line mistake."""
    plain = ip.run_cell_magic("autoparallel", "--gpus 1 --gpu h100-80gb", SEED_CELL)
    short = ip.run_cell_magic("autoparallel", "--gpus 1 --gpu h100-80gb --steps 20", SEED_CELL)
    assert short.steps == 20 and plain.steps is None
    weighed = [{lv.name: lv.steps for lv in s.plan.levers}["compile"] for s in (plain, short)]
    assert weighed == [10_000, 20]
    assert any("within the 20 steps planned" in x for x in short.plan.explanation), short.plan.explanation
    with pytest.raises(UsageError, match="--steps must be >= 1"):
        ip.run_cell_magic("autoparallel", "--steps 0", SEED_CELL)


def test_help_documents_every_option_with_an_example():
    doc = AutoparallelMagics.autoparallel.__doc__
    for option in ("--gpus", "--nodes", "--gpu", "--batch", "--name", "--model", "--inputs", "--dtype", "--mode",
                   "--fix", "--include-cells", "--steps", "--memory", "--weights"):
        assert option in doc, option
    assert "In [2]: %%autoparallel" in doc
    assert doc.count("Example:") >= 7


def test_calibrated_factors_reach_the_next_plan(ip):
    import json
    import os

    from autopar_nb import calibration

    path = calibration.path()
    assert str(path) == os.environ["AUTOPAR_CALIBRATION"]  # tests never touch the user's file
    factors = {"eff_matmul": 0.01, "eff_fp32_matmul": 0.01}  # as run.calibrate() stores them for a slow machine
    path.write_text(json.dumps({"version": 1, "presets": {"cpu": {"factors": factors, "history": []}}}))
    try:
        s = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2", SEED_CELL)
        assert s.cluster.calibration == factors
        slow = s.plan.cost.compute_s
        calibration.reset("cpu")
        s2 = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2", SEED_CELL)
        assert s2.cluster.calibration == {} and s2.plan.cost.compute_s < slow
    finally:
        calibration.reset()
