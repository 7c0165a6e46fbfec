"""The models people bring: twenty-six families built from Hugging Face configs with their default flags (dropout,
tied embeddings, caches, fused projections, MoE, ALiBi), tiny sizes, and the steps a new user takes with each: capture
and plan (``%%autoparallel``), verify the planner's plan, verify ``--fix tp=2`` and ``--fix dp=2,zero=3``, export and
``torchrun``. ``run_matrix`` runs them (the verify cases of all families in ONE launch of 2 processes, their
exported scripts one after another in ONE torchrun launch) and returns a table; ``tests/test_zoo.py`` asserts it,
``families.py --readme`` writes the README's family tables from it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

LM = """\
import torch
from transformers import {config}, {model}

config = {config}({args})
model = {model}(config)
example_inputs = (torch.randint(0, 128, (4, 16)),)
"""

FAMILIES = {
    "GPT-2": LM.format(config="GPT2Config", model="GPT2LMHeadModel",
                       args="vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4"),
    "LLaMA": LM.format(config="LlamaConfig", model="LlamaForCausalLM",
                       args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                            "                     num_attention_heads=4, num_key_value_heads=2, "
                            "max_position_embeddings=64"),
    "Qwen2": LM.format(config="Qwen2Config", model="Qwen2ForCausalLM",
                       args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                            "                     num_attention_heads=4, num_key_value_heads=2, "
                            "max_position_embeddings=64"),
    "Phi-3": LM.format(config="Phi3Config", model="Phi3ForCausalLM",
                       args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                            "                    num_attention_heads=4, max_position_embeddings=64, pad_token_id=0"),
    "GPT-NeoX": LM.format(config="GPTNeoXConfig", model="GPTNeoXForCausalLM",
                          args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                               "                       num_attention_heads=4, max_position_embeddings=64"),
    "Gemma": LM.format(config="GemmaConfig", model="GemmaForCausalLM",
                       args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                            "                     num_attention_heads=4, num_key_value_heads=1, head_dim=8, "
                            "max_position_embeddings=64"),
    # eager attention by default (logit soft-capping), alternating sliding-window layers, a hybrid cache
    "Gemma2": LM.format(config="Gemma2Config", model="Gemma2ForCausalLM",
                        args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                             "                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, "
                             "max_position_embeddings=64"),
    "BERT": LM.format(config="BertConfig", model="BertForMaskedLM",
                      args="vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,\n"
                           "                    intermediate_size=64, max_position_embeddings=64"),
    "T5": """\
import torch
from transformers import T5Config, T5ForConditionalGeneration

config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                  decoder_start_token_id=0)  # transformers 5 needs it to shift labels (t5-small's config has it)
model = T5ForConditionalGeneration(config)
example_inputs = {"input_ids": torch.randint(0, 128, (4, 16)), "labels": torch.randint(0, 128, (4, 8))}
""",
    "ViT": """\
import torch
from transformers import ViTConfig, ViTForImageClassification

config = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=64, num_labels=10)
model = ViTForImageClassification(config)
example_inputs = {"pixel_values": torch.randn(4, 3, 16, 16), "labels": torch.randint(0, 10, (4,))}
""",
    "Mixtral": LM.format(config="MixtralConfig", model="MixtralForCausalLM",
                         args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                              "                      num_attention_heads=4, num_key_value_heads=2, "
                              "num_local_experts=4,\n                      num_experts_per_tok=2, "
                              "max_position_embeddings=64"),
    # ALiBi: the model makes every head's bias once and hands it to each attention (MPT: by keyword, split with the
    # heads on the way in; Bloom: folded into the batch and added inside baddbmm, cut to the rank's heads of every
    # batch row on the way in)
    "MPT": """\
import torch
from transformers import MptConfig, MptForCausalLM

model = MptForCausalLM(MptConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=8, max_seq_len=64))
example_inputs = (torch.randint(0, 128, (4, 16)),)
""",
    "Bloom": """\
import torch
from transformers import BloomConfig, BloomForCausalLM

model = BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4))
example_inputs = (torch.randint(0, 128, (4, 16)),)
""",
    # sliding-window attention (4096 by default: wider than the tiny sequence)
    "Mistral": LM.format(config="MistralConfig", model="MistralForCausalLM",
                         args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                              "                      num_attention_heads=4, num_key_value_heads=2, "
                              "max_position_embeddings=64"),
    # RMSNorm of every head's q and k (a norm over head_dim, inside the attention)
    "Qwen3": LM.format(config="Qwen3Config", model="Qwen3ForCausalLM",
                       args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                            "                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, "
                            "max_position_embeddings=64"),
    # routed experts beside a shared expert behind a sigmoid gate
    "Qwen2-MoE": LM.format(config="Qwen2MoeConfig", model="Qwen2MoeForCausalLM",
                           args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                                "                        num_attention_heads=4, num_key_value_heads=2, num_experts=4, "
                                "num_experts_per_tok=2,\n                        moe_intermediate_size=16, "
                                "shared_expert_intermediate_size=32, max_position_embeddings=64"),
    # MLA (low-rank q and kv with their norms, one rope key shared by every head), a dense first layer, then
    # grouped top-k routed experts and a shared expert
    "DeepSeek-V3": LM.format(config="DeepseekV3Config", model="DeepseekV3ForCausalLM",
                             args="vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,\n"
                                  "                          num_hidden_layers=2, num_attention_heads=4, "
                                  "num_key_value_heads=4, n_routed_experts=4,\n"
                                  "                          num_experts_per_tok=2, n_group=2, topk_group=1, "
                                  "first_k_dense_replace=1, q_lora_rank=16,\n"
                                  "                          kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, "
                                  "v_head_dim=8, max_position_embeddings=64"),
    # learned positions offset by 2, ReLU MLP as two Linears beside the attention (fc1, fc2), dropout
    "OPT": LM.format(config="OPTConfig", model="OPTForCausalLM",
                     args="vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,\n"
                          "                   word_embed_proj_dim=32, max_position_embeddings=64"),
    # multi-query attention in one fused query_key_value (q heads then one k and one v), attention and MLP in
    # parallel from one LayerNorm
    "Falcon": LM.format(config="FalconConfig", model="FalconForCausalLM",
                        args="vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4"),
    # attention and MLP in parallel, rotary on the first rotary_dim of each head (interleaved pairs)
    "GPT-J": LM.format(config="GPTJConfig", model="GPTJForCausalLM",
                       args="vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,\n"
                            "                     bos_token_id=0, eos_token_id=0"),
    # partial rotary, a parallel block, biases everywhere, an untied head with a bias
    "Phi": LM.format(config="PhiConfig", model="PhiForCausalLM",
                     args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                          "                   num_attention_heads=4, max_position_embeddings=64"),
    # LayerNorm, a quarter of each head rotated
    "StableLM": LM.format(config="StableLmConfig", model="StableLmForCausalLM",
                          args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                               "                        num_attention_heads=4, num_key_value_heads=2, "
                               "max_position_embeddings=64"),
    # LayerNorm with no weight or bias
    "OLMo": LM.format(config="OlmoConfig", model="OlmoForCausalLM",
                      args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                           "                    num_attention_heads=4, max_position_embeddings=64, eos_token_id=0"),
    # GELU MLP with biases (c_fc, c_proj), GQA with biases, tied head
    "Starcoder2": LM.format(config="Starcoder2Config", model="Starcoder2ForCausalLM",
                            args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                                 "                          num_attention_heads=4, num_key_value_heads=2, "
                                 "max_position_embeddings=64"),
    # attention and MLP in parallel, LayerNorm without bias in Python, a tied head with scaled logits
    "Cohere": LM.format(config="CohereConfig", model="CohereForCausalLM",
                        args="vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
                             "                      num_attention_heads=4, num_key_value_heads=2, "
                             "max_position_embeddings=64, eos_token_id=0"),
    # StarCoder's: multi-query attention (one key/value head) from a fused c_attn cut by features, learned positions
    "GPTBigCode": LM.format(config="GPTBigCodeConfig", model="GPTBigCodeForCausalLM",
                            args="vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4"),
    "CNN + BatchNorm": """\
import torch
import torch.nn as nn


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


model = nn.Sequential(block(3, 8), block(8, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
example_inputs = (torch.randn(4, 3, 16, 16),)
""",
}

BRINGS = {
    "GPT-2": "tied embedding/head, fused `Conv1D` q\\|k\\|v (split part by part), dropout",
    "LLaMA": "GQA, RMSNorm in Python (sequence parallel), rotary tables",
    "Qwen2": "GQA with q/k/v biases",
    "Phi-3": "fused `qkv_proj` and `gate_up_proj`",
    "GPT-NeoX": "per-head interleaved fused q\\|k\\|v",
    "Gemma": "1 key/value head (repeated under TP), tied head",
    "Gemma2": "eager attention (soft-capped scores as plain matmuls), alternating sliding-window layers",
    "BERT": "masked-LM head tied to the embedding (weight and bias), dropout",
    "T5": "encoder-decoder, shared embedding, relative position bias (split by heads), `labels`",
    "ViT": "image patches, classification `labels`",
    "Mixtral": "mixture of experts (costed by active parameters; expert parallelism with `--fix ep=N`)",
    "MPT": "ALiBi made by the model, handed to each attention by keyword (cut to the rank's heads under TP)",
    "Bloom": "ALiBi folded into the batch and added inside `baddbmm` (cut to the rank's heads in every batch row under "
             "TP), a norm of the embeddings alone before the blocks",
    "Mistral": "sliding-window attention (wider than the sequence), GQA",
    "Qwen3": "RMSNorm of every head's q and k (the norms run on each rank's heads, their gradient summed)",
    "Qwen2-MoE": "routed experts beside a shared expert behind a sigmoid gate",
    "DeepSeek-V3": "MLA (low-rank q and kv, one rope key every head reads: its gradient summed under TP), a dense "
                   "first layer, grouped top-k experts",
    "OPT": "learned positions offset by 2, ReLU MLP in the decoder layer itself, dropout",
    "Falcon": "multi-query fused `query_key_value` (query heads split, the key/value rows on every rank), attention "
              "and MLP in parallel, `FalconLinear` (an `nn.Linear` with its own forward)",
    "GPT-J": "attention and MLP in parallel, rotary on part of each head",
    "Phi": "partial rotary, parallel block, biases everywhere, untied head with a bias",
    "StableLM": "LayerNorm, a quarter of each head rotated, GQA",
    "OLMo": "LayerNorm without weight or bias",
    "Starcoder2": "GELU MLP and GQA with biases, tied head",
    "Cohere": "parallel block, LayerNorm in Python, tied head with scaled logits",
    "GPTBigCode": "multi-query `c_attn` cut by features into parts of widths [32, 8, 8] (split as one block, its "
                  "output gathered: the attention core runs whole), dropout",
    "CNN + BatchNorm": "SyncBatchNorm over data-parallel ranks (on CPU too)",
}
"""what each family brings that a planner must handle: the README's table (:func:`readme_tables`)"""

STEPS = ("capture + plan", "verify auto", "verify tp=2", "verify dp=2,zero=3", "export + torchrun")
REFUSED = {("CNN + BatchNorm", "verify tp=2"): "no Linear/Embedding that TP can split"}
"""what may be refused, and the reason the refusal must give (a CNN has nothing TP splits); every other step of
every family must pass (``tests/test_zoo.py`` asserts both, so the README's table, made from them, is what it checks)"""
FIXES = {"verify auto": {}, "verify tp=2": {"tp": 2}, "verify dp=2,zero=3": {"dp": 2, "zero_stage": 3}}


def plans(cell: str, ip) -> tuple[object, dict[str, object]]:
    """``%%autoparallel --gpu cpu --gpus 2`` on the cell (capture once), then the planner's plan for each fix:
    (session or the error, step -> Plan or the error)."""
    try:
        session = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --batch 4 --name zoo_session", cell)
    except BaseException as e:  # a UsageError says why the cell cannot be captured or planned
        return e, {}
    out = {}
    for step, fix in FIXES.items():
        try:
            session.replan(fix=fix)
            out[step] = session.plan_for(2)
        except BaseException as e:
            out[step] = e
    return session, out


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text[:160]


def run_matrix(names: list[str], workdir: Path, *, verify_steps: int = 2) -> dict[tuple[str, str], str]:
    """(family, step) -> "ok" or the first line of why not. Verify cases share one launch of 2 processes; each
    family's planned script also runs under torchrun (2 processes, 2 steps; the scripts share one launch)."""
    from IPython.core.interactiveshell import InteractiveShell

    from autopar_nb.export import export
    from autopar_nb.verify import verify_many

    ip = InteractiveShell.instance()  # the one the other tests share, if any
    ip.run_line_magic("load_ext", "autopar_nb")
    table: dict[tuple[str, str], str] = {}
    cases, keys, planned = [], [], {}
    for name in names:
        session, found = plans(FAMILIES[name], ip)
        table[(name, "capture + plan")] = "ok" if not isinstance(session, BaseException) else _short(session)
        for step, plan in found.items():
            if isinstance(plan, BaseException):
                table[(name, step)] = _short(plan)
            else:
                cases.append((session.source, plan))
                keys.append((name, step))
        if not isinstance(found.get("verify auto", None), (BaseException, type(None))):
            planned[name] = (session.source, found["verify auto"])
    reports = []
    try:
        reports = verify_many(cases, steps=verify_steps, nproc=2) if cases else []
    except Exception:  # one case broke the whole launch: run them one by one to say which
        for key, case in zip(keys, cases, strict=True):
            try:
                reports.append(verify_many([case], steps=verify_steps, nproc=2)[0])
            except Exception as e:
                reports.append(e)
                table[key] = _short(e)
    for key, report in zip(keys, reports, strict=True):
        if isinstance(report, BaseException):
            continue
        table[key] = "ok" if report.ok else f"mismatch: {str(report).splitlines()[0]}"
    table.update(_torchrun_all(planned, workdir, export))
    return table


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower())


def _export(source, plan, path: Path, export) -> Path | str:
    """The exported script, or why there is none to run."""
    try:
        script = export(source, plan, path, steps=2, quiet=True).script
    except Exception as e:
        return _short(e)
    if len(script.read_text().splitlines()) > 200:  # the script a person reads (its runtime module beside it)
        return f"{script.name}: {len(script.read_text().splitlines())} lines, more than 200"
    return script


def _torchrun(source, plan, path: Path, export) -> str:
    """Export the plan and run the script cold under ``torchrun`` (2 processes, 2 steps): "ok" or why not."""
    script = _export(source, plan, path, export)
    if isinstance(script, str):
        return script
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=300, env=_ENV, cwd=path.parent)
    if proc.returncode == 0 and "step 1 | loss" in proc.stdout:
        return "ok"
    lines = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
    return f"torchrun failed: {(lines[-1] if lines else proc.stderr[-200:]).strip()[:160]}"


_ENV = dict(os.environ, PYTHONWARNINGS="ignore")
RUN_SCRIPTS = """\
import gc
import runpy
import sys

import torch.distributed as dist

dist.init_process_group("gloo")  # each script's main() finds it and leaves it open
for script in sys.argv[1:]:
    if dist.get_rank() == 0:
        print(f"== {script}", flush=True)
    runpy.run_path(script, run_name="__one_of_several__")["main"]([])
    gc.collect()
    dist.barrier()  # every rank finished it
    if dist.get_rank() == 0:
        print(f"== ok {script}", flush=True)
gc.collect()  # a gloo thread taking the GIL during shutdown aborts some exits otherwise
dist.destroy_process_group()
"""
"""runs exported scripts one after another in ONE torchrun launch, in one process group: each cold launch costs
seconds of start-up (torch and transformers imported by the agent and both ranks), a tiny model's two steps less"""


def _torchrun_all(planned: dict[str, tuple], workdir: Path, export) -> dict[tuple[str, str], str]:
    """(family, "export + torchrun") -> "ok" or why not, for each family's planned plan. The scripts share one
    launch of 2 processes; every script whose two steps that launch did not print (the one that broke it, and those
    after) runs again in a launch of its own, which says why."""
    out, scripts = {}, {}
    for name, (source, plan) in planned.items():
        script = _export(source, plan, workdir / f"train_{_slug(name)}.py", export)
        if isinstance(script, str):
            out[(name, "export + torchrun")] = script
        else:
            scripts[name] = script
    (workdir / "run_scripts.py").write_text(RUN_SCRIPTS)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "run_scripts.py", *(str(s) for s in scripts.values())], capture_output=True, text=True,
                          timeout=600, env=_ENV, cwd=workdir)
    for name, script in scripts.items():
        done = re.search(rf"^== {re.escape(str(script))}$(.*)^== ok {re.escape(str(script))}$", proc.stdout,
                         re.S | re.M)
        if done and "step 1 | loss" in done.group(1):
            out[(name, "export + torchrun")] = "ok"
        else:
            source, plan = planned[name]
            out[(name, "export + torchrun")] = _torchrun(source, plan, script, export)
    return out


# ---- what each family gets: TP inside a block, SP, PP, EP, CP ---------------------------------------------------
KINDS = {"attention": ("Attention", "SelfAttention"), "MLP": ("MLP", "Mlp", "FeedForward", "Intermediate", "Output",
                                                              "DenseReluDense", "LayerFF", "SparseMoe", "Experts")}
"""a split module's kind, by the class names of the modules around it (innermost first: BERT's attention output
dense is inside BertSelfOutput inside BertAttention)"""
CAPABILITIES = ("TP: attention", "TP: MLP", "TP: embedding", "TP: output head", "SP", "PP", "EP", "CP")


def split_kinds(model, plan) -> set[str]:
    """What the plan's TP splits: "attention", "MLP" (a block's Linears outside its attention), "embedding", "output
    head" (a Linear outside the blocks)."""
    import torch.nn as nn

    kinds = set()
    for lp in plan.layers:
        for path, style in lp.tp.items():
            if style in ("replicate", "sequence_parallel", "shared", "per_head"):  # whole on every rank
                continue
            module = model.get_submodule(path)
            if isinstance(module, nn.Embedding):
                kinds.add("embedding")
                continue
            parts = path.split(".")
            around = [type(model.get_submodule(".".join(parts[:i]))).__name__ for i in range(len(parts), 0, -1)]
            kind = next((k for name in around for k, words in KINDS.items() if any(w in name for w in words)), None)
            # a Linear of a block outside its attention is its MLP (OPT's fc1 and fc2 sit in the decoder layer)
            kinds.add(kind or ("output head" if lp.path == path else "MLP"))
    return kinds


def capabilities(names: list[str]) -> dict[str, dict[str, str]]:
    """family -> column of :data:`CAPABILITIES` -> "✓", or why not: what the planner gives each family on 2 CPU
    processes (``--fix tp=2``, ``pp=2``, ``ep=2`` for expert models, ``cp=2``)."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "autopar_nb")
    out = {}
    for name in names:
        try:
            session = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --batch 4 --name zoo_session",
                                        FAMILIES[name])
        except BaseException as e:
            out[name] = {c: "✗ " + _short(e) for c in CAPABILITIES}
            continue
        row = out[name] = {}
        try:
            tp = session.replan(fix={"tp": 2})
            kinds = split_kinds(ip.user_ns["model"], tp)
            for kind in ("attention", "MLP", "embedding", "output head"):
                row[f"TP: {kind}"] = "✓" if kind in kinds else "—"
            row["SP"] = "✓" if any(lp.sequence_parallel for lp in tp.layers) else "—"
        except BaseException as e:
            row.update({c: "—" for c in CAPABILITIES[:5]}, **{"TP: attention": "✗ " + _why(e)})
        for column, fix in (("PP", {"pp": 2}), ("EP", {"ep": 2}), ("CP", {"cp": 2})):
            try:
                session.replan(fix=fix)
                row[column] = "✓"
            except BaseException as e:
                row[column] = "— (no experts)" if "no experts" in str(e) else "✗ " + _why(e)
    return out


def _why(e: BaseException) -> str:
    """The planner's reason, without the fix it answers: 'the model has no Linear/Embedding that TP can split'."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    text = text.split(": ", 1)[1] if text.startswith("fix ") and ": " in text else text
    text = text.split(", but ", 1)[1] if text.startswith("fix ") and ", but " in text else text
    return text if len(text) <= 110 else text[:107].rsplit(" ", 1)[0] + " ..."


def capability_markdown(table: dict[str, dict[str, str]]) -> str:
    rows = ["| family | " + " | ".join(CAPABILITIES) + " |", "|---" * (len(CAPABILITIES) + 1) + "|"]
    rows += [f"| {name} | " + " | ".join(row[c].replace("|", "/") for c in CAPABILITIES) + " |"
             for name, row in table.items()]
    return "\n".join(rows)


def markdown(table: dict[tuple[str, str], str], names: list[str]) -> str:
    """The table as Markdown: ✓ where the step works, the reason where it does not."""
    rows = ["| family | " + " | ".join(STEPS) + " |", "|---" * (len(STEPS) + 1) + "|"]
    for name in names:
        cells = [("✓" if table.get((name, s)) == "ok" else "✗ " + table.get((name, s), "not run").replace("|", "/"))
                 for s in STEPS]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


README = Path(__file__).resolve().parents[1] / "README.md"
MARKS = {"steps": ("<!-- families.py: steps -->", "<!-- /families.py: steps -->"),
         "capabilities": ("<!-- families.py: capabilities -->", "<!-- /families.py: capabilities -->")}
"""where the README's family tables start and end (``families.py --readme`` writes between them)"""


def steps_table() -> str:
    """Every family with what it brings and each step: ✓, or the refusal :data:`REFUSED` names — what
    ``tests/test_zoo.py`` asserts, so a family added to :data:`FAMILIES` is a row here."""
    rows = ["| family | what it brings | " + " | ".join(STEPS) + " |", "|---" * (len(STEPS) + 2) + "|"]
    for name in FAMILIES:
        cells = ["refused: " + REFUSED[(name, s)] if (name, s) in REFUSED else "✓" for s in STEPS]
        rows.append(f"| {name} | {BRINGS[name]} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def readme_section(text: str, kind: str) -> str:
    """The README text between :data:`MARKS` ``kind``'s markers, stripped."""
    start, end = MARKS[kind]
    if start not in text or end not in text:
        raise ValueError(f"README.md lacks the markers {start} ... {end}")
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def write_readme(capability_md: str, note: str) -> None:
    """README.md's family tables rewritten between their markers: the steps (:func:`steps_table`) and what each
    family gets (``capability_md``, :func:`capability_markdown` of a run, ``note`` saying when and where)."""
    text = README.read_text()
    for kind, body in (("steps", steps_table()), ("capabilities", f"{note}\n\n{capability_md}")):
        start, end = MARKS[kind]
        old = readme_section(text, kind)
        text = text.replace(f"{start}\n{old}\n{end}", f"{start}\n{body}\n{end}", 1)
    README.write_text(text)


def main() -> None:
    import tempfile

    args = [a for a in sys.argv[1:] if a not in ("--capabilities", "--readme")]
    names = list(FAMILIES) if not args else args[0].split(",")
    t0 = time.time()
    if "--readme" in sys.argv:  # every family, so that the README lists each one
        table = capability_markdown(capabilities(list(FAMILIES)))
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        where = f"{time.time() - t0:.0f} s on {os.cpu_count()} CPU cores at load {os.getloadavg()[0]:.0f}"
        write_readme(table, f"What each family gets (`cd tests && ../.venv/bin/python families.py --readme`, {when}, "
                            f"{where}):")
        print(table)
        return
    if "--capabilities" in sys.argv:
        print(capability_markdown(capabilities(names)))
        print(f"\n({time.time() - t0:.0f} s)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        try:
            table = run_matrix(names, Path(tmp))
        except Exception:
            traceback.print_exc()
            raise
    print(markdown(table, names))
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
