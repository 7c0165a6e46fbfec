"""Lines of the exported ``train.py`` and of its runtime module, per plan kind, and whether ``train.py`` passes ruff
under its default rules (line length 120).

Run: .venv/bin/python bench/export.py        (about 3 minutes on 2 cores: every model is captured on meta)
Prints the table of the "## Export" section of BENCHMARKS.md: the 32-layer LLaMA of
``tests/test_render.py::test_32_layer_llama_script_stays_short``, the 8-layer GPT and LLaMA of that file under every
technique it renders, and the planner's plans of every family of ``tests/families.py`` (``--gpus 2``: the plan it
proposes, ``tp=2``, ``dp=2,zero=3``).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def measure(source, plan, folder: Path, name: str) -> tuple[int, int, str]:
    """(train.py lines, runtime module lines, ruff's verdict on train.py under its defaults), exported to
    ``folder/name/train.py``."""
    from autopar_nb.export import export

    out = export(source, plan, folder / name / "train.py", quiet=True)  # as a user names it: the docstring wraps so
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--line-length", "120",
                           out.script.name], capture_output=True, text=True, cwd=out.script.parent)
    verdict = "clean" if proc.returncode == 0 else proc.stdout.strip().splitlines()[-1]
    return len(out.script.read_text().splitlines()), len(out.runtime.read_text().splitlines()), verdict


def rows(folder: Path):
    from families import FAMILIES, plans
    from IPython.core.interactiveshell import InteractiveShell
    from test_render import FIXES as TECHNIQUES
    from test_render import GPT8, HF_LLAMA, _planned

    src, plan = _planned(HF_LLAMA.format(layers=32), {"tp": 2, "dp": 4, "zero_stage": 3, "sequence_parallel": True,
                                                      "recompute": "selective"})
    yield "LLaMA 32 layers", "tp=2 sp dp=4 zero=3 selective", measure(src, plan, folder, "llama32")
    for model, cell in (("GPT 8 layers", GPT8), ("LLaMA 8 layers", HF_LLAMA.format(layers=8))):
        for kind, fix in TECHNIQUES.items():
            if model.startswith("LLaMA") and "pp" in fix:
                continue  # as tests/test_render.py: HF LLaMA's rotary tables cross every stage
            src, plan = _planned(cell, fix)
            yield model, kind, measure(src, plan, folder, f"{model}-{kind}")
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "autopar_nb")
    for family, cell in FAMILIES.items():
        session, found = plans(cell, ip)
        for step, plan in found.items():
            kind = step.replace("verify ", "")
            if isinstance(plan, BaseException):
                yield family, kind, (0, 0, f"not planned: {type(plan).__name__}")
                continue
            yield family, kind, measure(session.source, plan, folder, f"{family}-{kind}")


def main() -> None:
    print("| model | plan | train.py | runtime module | ruff (defaults) |")
    print("|---|---|---:|---:|---|")
    with tempfile.TemporaryDirectory(prefix="autopar-bench-export-") as tmp:
        for model, kind, (lines, runtime, verdict) in rows(Path(tmp)):
            print(f"| {model} | {kind} | {lines} | {runtime} | {verdict} |", flush=True)


if __name__ == "__main__":
    main()
