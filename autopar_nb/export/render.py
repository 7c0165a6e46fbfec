"""The one-file script's text (``export(single_file=True)``): settings as literals
(:mod:`.settings`), the cell verbatim, the runtime's functions verbatim (:mod:`.kit`), and two short
functions written for the plan, ``parallelize`` (:mod:`.parallelize`) and ``main``'s body
(:mod:`.main_body`), that only call them. The two-file export (:mod:`.script`) reuses the settings,
``parallelize`` and ``main``'s body.

Every value from the plan reaches the text through ``repr`` of a checked Python value
(:mod:`.literals`, or a ``TPStyle``'s constructor), never pasted as code.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from string import Template

from ..plan import Plan
from ..source import ModelSource
from . import kit
from .cell import PRETRAINED, check_names, script_cell, without_cell_imports
from .main_body import main_source
from .parallelize import parallelize_source
from .settings import settings
from .values import ScriptValues

TEMPLATE = Path(__file__).with_name("script.py.tmpl")
PRELUDE = ("process_rss",)
"""runtime functions the script calls before the cell"""
DATA_FLAGS = '''
    p.add_argument("--num-workers", type=int, default=default_num_workers(),
                   help="DataLoader worker processes per rank (default: the cores each rank has "
                   "beyond its own, at most 4)")
    p.add_argument("--prefetch-factor", type=int, default=2,
                   help="batches each DataLoader worker loads ahead")'''
"""``parse_args``'s flags for a script that reads the cell's dataset"""
HF_FLAGS = '''
    p.add_argument("--save-hf", default=None, metavar="DIR",
                   help="at the end, write the trained weights to DIR in Hugging Face's format "
                   "(safetensors + config.json)")'''
"""``parse_args``'s flag for a Hugging Face model the cell loads ``from_pretrained``"""
TEMPLATE_IMPORTS = {("argparse", None, None), ("gc", None, None), ("traceback", None, None),
                    ("torch", None, None), ("torch.distributed", None, "dist"),
                    ("torch.distributed.elastic.multiprocessing.errors", "record", None)}


def summary_lines(model_name: str, summary: str) -> str:
    """The plan's summary as the docstring's first sentence (``Train <model> with <summary>.``),
    wrapped at 120 columns where a long plan (many techniques) makes it longer."""
    lead = f'"""Train {model_name} with '
    text = textwrap.fill(lead + summary + ".", width=120, break_long_words=False,
                         break_on_hyphens=False)
    return text[len(lead):-1]

def render_script(source: ModelSource, plan: Plan, v: ScriptValues, *, script_name: str,
                  plan_file: str, steps: int, seed: int, launch: str) -> str:
    """The whole script (see the module docstring)."""
    setting_lines, setting_imports = settings(v, plan, seed=seed)
    par, par_uses, par_imports = parallelize_source(v)
    body, main_uses = main_source(v, source)
    # what the cell's lines call
    prelude = kit.assemble([*PRELUDE, *(PRETRAINED if v.from_config else ())])
    assembly = kit.assemble([*par_uses, *main_uses, "failure_line"])  # the template's own call
    # defined once, before the cell
    assembly.blocks = [b for b in assembly.blocks if b[1] not in prelude.names]
    std = {("functools", None, None)} | ({("copy", None, None)} if v.meta_init else set())
    check_names(source, assembly.names + prelude.names)
    imports = without_cell_imports(
        assembly.imports | prelude.imports | TEMPLATE_IMPORTS | std | par_imports, source,
        keep=setting_imports | prelude.imports)
    flags = (DATA_FLAGS if v.dataset else "") + (HF_FLAGS if v.save_hf else "")
    return Template(TEMPLATE.read_text()).substitute(
        model_name=v.model_class, summary=summary_lines(v.model_class, plan.summary()),
        plan_file=plan_file, intro=textwrap.fill(f"Exported by autopar-nb from a notebook cell. "
                                                 "The cell is kept verbatim below; the plan "
                            f"({plan_file} beside this file) is applied by the functions of "
                            "autopar_nb.runtime, copied below; nothing but torch (and the cell's "
                            "own imports) is needed.", width=116),
        launch=launch,
        imports="\n\n".join(kit.with_early(imports, setting_imports)),
        settings="\n".join(setting_lines), prelude=prelude.source(), cell=script_cell(source, v),
        kit=assembly.source(), parallelize=par, steps=int(steps), main=body, data_flags=flags,
        build_mesh="build_mesh(device, PP, DP, TP" + (", cp=CP)" if v.cp > 1 else ")"))
