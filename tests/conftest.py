import os
import shutil
import signal
import tempfile

# This is the CPU suite (gloo, 2-4 processes): on a GPU host — a lent H200, a workstation — the workers, verify's
# reference and the planner would otherwise pick CUDA and NCCL, and 2-4 ranks on one GPU are refused by design. The
# GPU paths are checked by `make gpu-check` (bench/gpu_check.py). Set before torch can read it; the tests that
# simulate GPU hosts set their own. AUTOPAR_TEST_GPUS=1 leaves the GPUs visible.
if os.environ.get("AUTOPAR_TEST_GPUS") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
# Everything the suite and the processes it starts put in the temporary directory (pytest's tmp_path, run and
# verify directories, torchelastic's logs, multiprocessing's) goes in one folder, removed when pytest ends
SCRATCH = tempfile.mkdtemp(prefix="autopar-tests-")
os.environ["TMPDIR"] = tempfile.tempdir = SCRATCH
# measured calibration factors of the developer's own runs must not change what the tests plan
os.environ["AUTOPAR_CALIBRATION"] = os.path.join(SCRATCH, "calibration.json")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
"""set in a pytest-xdist worker (``make test``)"""


def pytest_configure(config):
    # execnet starts xdist's workers with SIGINT ignored, and children inherit an ignored signal: Jupyter's
    # Interrupt kernel, launch's KeyboardInterrupt and torchrun's stop would reach nothing
    if XDIST_WORKER:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config):
    shutil.rmtree(SCRATCH, ignore_errors=True)


NAMESPACE_FILES = dict.fromkeys(["test_multinode", "test_slurm", "test_soak"], "namespaces")
"""files whose tests make network namespaces, Slurm daemons and minutes-long soaks: one worker runs them in turn"""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``--dist loadgroup`` (``make test``), a file's tests run on one worker, one after
    another: its module-scoped launches, pools and captures are shared as in a plain run. A test's own
    ``xdist_group`` (files that must not run beside each other) wins."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(NAMESPACE_FILES.get(item.path.stem, item.path.stem)))
    if XDIST_WORKER:  # the longest group first, so that the other worker takes the rest beside it
        items.sort(key=lambda item: item.path.stem not in NAMESPACE_FILES)


@pytest.fixture
def ip():
    """An in-process IPython shell with autopar_nb loaded; the names a test adds are removed afterwards."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "autopar_nb")
    before = set(shell.user_ns)
    yield shell
    for name in set(shell.user_ns) - before:
        del shell.user_ns[name]


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone: runtime code that calls collectives, run in one process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def llama_8b():
    """LLaMA 3 8B captured on the meta device, 8 x 4096 tokens (the planner's tests at scale)."""
    import autopar_nb as ap
    from autopar_nb import zoo

    with torch.device("meta"):
        model = zoo.Llama(zoo.LLAMA3_8B)
    return ap.capture(model, torch.randint(0, 100, (8, 4096), device="meta"))


@pytest.fixture(scope="module")
def small_llama():
    """The tests' small LLaMA cell, captured on the meta device (it fits 2 CPU ranks)."""
    from runtime_cases import LLAMA_CELL, source

    import autopar_nb as ap

    model, inputs, _ = source(LLAMA_CELL).build(device="meta")
    return ap.capture(model, *inputs)
