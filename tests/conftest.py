import os
import tempfile

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
# measured calibration factors of the developer's own runs must not change what the tests plan
os.environ["AUTOPAR_CALIBRATION"] = os.path.join(tempfile.mkdtemp(prefix="autopar-test-"), "calibration.json")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
