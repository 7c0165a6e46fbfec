"""A cell that calls ``from_pretrained`` starts training from those weights.

Capture builds the checkpoint's model from its config on the meta device (transformers refuses ``from_pretrained``
there); the exported script reads the weights in the cell where it builds the model whole, and, under ``meta_init``,
each rank reads only its shards into the parallelised model (DCP's Hugging Face reader), with tied weights the
checkpoint leaves out and fused projections. The checkpoints here are tiny models saved by ``save_pretrained`` whose
final norm is zero: their logits are all zero, so their first loss is exactly log(vocab) on any batch, which a model
initialised at random (what a run that failed to read the weights would start from) is not.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from runtime_cases import has_transformers

import autopar_nb as ap
from autopar_nb.notebook.cell import run_model_cell
from autopar_nb.source import PRETRAINED_KEY

pytestmark = pytest.mark.skipif(not has_transformers(), reason="needs transformers")

VOCAB = 256
CELL = """
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({path!r})
example_inputs = torch.randint(0, {vocab}, (8, 32))
"""


LLAMA = ("LlamaConfig(vocab_size={vocab}, hidden_size=64, intermediate_size=128, num_hidden_layers=2, "
         "num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)")
CONFIG_CELL = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM({config})
example_inputs = torch.randint(0, {vocab}, (8, 32))
"""
"""the saved LLaMA's model built from its config in the cell: ``weights=`` names the checkpoint it starts from"""


def _save(kind: str, folder) -> str:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
    )

    torch.manual_seed(3)
    if kind == "llama":
        model = LlamaForCausalLM(eval(LLAMA.format(vocab=VOCAB), {"LlamaConfig": LlamaConfig}))
        final = model.model.norm
    elif kind == "mixtral":  # stored under other names than its modules': transformers converts them as it loads
        model = MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 num_local_experts=8, num_experts_per_tok=2,
                                                 max_position_embeddings=64))
        final = model.model.norm
    else:  # GPT-2: the output head tied to the embedding (not in the checkpoint), a fused [q|k|v] Conv1D
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                           bos_token_id=0, eos_token_id=0))
        final = model.transformer.ln_f
    with torch.no_grad():
        for p in final.parameters():
            p.zero_()
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return {kind: _save(kind, tmp_path_factory.mktemp(kind)) for kind in ("llama", "gpt2", "mixtral")}


def _source(path: str):
    return run_model_cell(CELL.format(path=path, vocab=VOCAB), {}).source


def _config_source(weights: str | None = None):
    source = run_model_cell(CONFIG_CELL.format(config=LLAMA.format(vocab=VOCAB), vocab=VOCAB), {}).source
    return dataclasses.replace(source, weights=weights)


def _case_source(saved, kind: str):
    """``"llama-config"``: the LLaMA built from its config, ``weights=`` its checkpoint; else a from_pretrained cell."""
    return _config_source(saved["llama"]) if kind == "llama-config" else _source(saved[kind])


def test_capture_builds_the_checkpoint_model_from_its_config_on_meta(saved):
    from transformers import PreTrainedModel

    before = PreTrainedModel.__dict__["from_pretrained"]
    model, inputs, ns = _source(saved["llama"]).build(device="meta")
    assert ns[PRETRAINED_KEY] == [saved["llama"]]
    assert all(p.is_meta for p in model.parameters()) and model.config.num_hidden_layers == 2
    assert PreTrainedModel.__dict__["from_pretrained"] is before  # transformers is left as it was
    real, _, ns = _source(saved["llama"]).build()
    assert PRETRAINED_KEY not in ns and not real.model.norm.weight.any()  # a real build reads the weights
    shapes = {name: p.shape for name, p in model.named_parameters()}
    assert shapes == {name: p.shape for name, p in real.named_parameters()}
    assert ap.capture(model, inputs).params


def test_meta_init_script_reads_the_shards_after_parallelize(saved, tmp_path):
    from autopar_nb.export.values import script_values

    src = _source(saved["gpt2"])
    model, inputs, _ = src.build(device="meta")
    plan = ap.plan(ap.capture(model, inputs), ap.Cluster.preset("cpu", 1, 4), global_batch=8,
                   fix={"tp": 2, "pp": 2, "micro_batches": 2})
    assert script_values(src, plan, meta_init=True).pretrained == saved["gpt2"]
    assert script_values(src, plan, meta_init=False).pretrained == ""  # the cell reads them itself
    text = ap.export(src, plan, tmp_path / "train.py", meta_init=True).script.read_text()
    assert "from_config = FromConfig().start()" in text
    assert "load_pretrained(from_config.found[-1], parts, model=skeleton, ties=TIES)" in text


def test_a_checkpoint_stored_under_other_names_reads_as_transformers_converts_it(saved):
    """Mixtral's checkpoint holds every expert's w1, w2, w3 under ``block_sparse_moe``; the model has ``mlp`` and
    stacked ``experts.gate_up_proj`` / ``down_proj``: read through transformers' own conversion mapping, the model
    equals what ``from_pretrained`` builds (shard by shard: the EP cases below)."""
    from transformers import MixtralForCausalLM

    from autopar_nb.runtime.pretrained import check_pretrained, load_pretrained, tied_parameters

    model, _, _ = _source(saved["mixtral"]).build(device="meta")
    check_pretrained(saved["mixtral"], model)  # no "stores no weight named": the names map
    expected = MixtralForCausalLM.from_pretrained(saved["mixtral"]).state_dict()
    mine = MixtralForCausalLM(model.config)
    load_pretrained(saved["mixtral"], [mine], ties=tied_parameters(mine))
    assert mine.state_dict().keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(mine.state_dict()[key], value), key


def test_a_missing_checkpoint_folder_is_one_clear_error(tmp_path):
    from autopar_nb.runtime.pretrained import load_pretrained

    with pytest.raises(FileNotFoundError, match="huggingface-cli download org/model --local-dir DIR"):
        load_pretrained("org/model", [torch.nn.Linear(2, 2)])


def test_weights_names_the_checkpoint_of_a_cell_built_from_a_config(saved, tmp_path):
    """``export(weights=DIR)``: the script reads DIR as it reads a from_pretrained cell's checkpoint (whole before
    parallelising, or each rank's shards after it under meta_init), and a real build of the source reads it too
    (verify's reference); a missing folder, or a checkpoint of another model, is one line at export."""
    src = _config_source()
    model, inputs, _ = src.build(device="meta")
    plan = ap.plan(ap.capture(model, inputs), ap.Cluster.preset("cpu", 1, 2), global_batch=8, fix={"tp": 2})
    whole = ap.export(src, plan, tmp_path / "whole.py", quiet=True, weights=saved["llama"]).script.read_text()
    assert f"WEIGHTS = {saved['llama']!r}".replace("'", '"') in whole
    assert "load_pretrained(WEIGHTS, [model])" in whole and "FromConfig" not in whole
    shards = ap.export(src, plan, tmp_path / "shards.py", quiet=True, weights=saved["llama"], meta_init=True)
    assert "load_pretrained(WEIGHTS, parts, model=skeleton)" in shards.script.read_text()
    real, _, _ = _config_source(saved["llama"]).build()
    assert not real.model.norm.weight.any()  # the checkpoint's zeroed final norm, not the config's ones
    with pytest.raises(FileNotFoundError, match=r"^weights='/no/such/dir': no such folder"):
        ap.export(src, plan, tmp_path / "a.py", quiet=True, weights="/no/such/dir")
    with pytest.raises(ValueError, match=r"stores no weight named model.embed_tokens.weight .*e\.g\. transformer\."):
        ap.export(src, plan, tmp_path / "b.py", quiet=True, weights=saved["gpt2"])
    with pytest.raises(ValueError, match="the cell starts from its own checkpoint"):
        ap.export(_source(saved["llama"]), plan, tmp_path / "c.py", quiet=True, weights=saved["llama"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards.plan.json", "shards.py", "shards_runtime.py",
                                                          "whole.plan.json", "whole.py", "whole_runtime.py"]


def test_the_magic_says_which_weights_the_plan_starts_from(ip, saved, capsys):
    from IPython.core.error import UsageError

    ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2", CELL.format(path=saved["llama"], vocab=VOCAB))
    assert f"starts from the weights in {saved['llama']}\n" in capsys.readouterr().out
    config_cell = CONFIG_CELL.format(config=LLAMA.format(vocab=VOCAB), vocab=VOCAB)
    session = ip.run_cell_magic("autoparallel", f"--gpu cpu --gpus 2 --weights {saved['llama']}", config_cell)
    assert session.source.weights == saved["llama"]  # what verify, launch and export read
    assert f"starts from the weights in {saved['llama']}\n" in capsys.readouterr().out
    ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2", config_cell)
    assert "starts from" not in capsys.readouterr().out  # random initial weights: nothing to say
    with pytest.raises(UsageError, match="--weights /no/such/dir: no such folder"):
        ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --weights /no/such/dir", config_cell)


# (checkpoint, fix, meta_init): the whole model read in the cell (a pipeline's other stages then free memory-mapped
# weights), and each rank's shards read after parallelize, under TP, FSDP and pipelining, with GPT-2's tied head on
# the other stage than its embedding, and Mixtral's experts (stored one by one under other names) stacked from
# only the experts each rank holds (8 experts: 4 per EP rank, 2 per rank once FSDP shards them); "llama-config":
# the LLaMA built from its config, export's weights= naming its checkpoint. verify's gradients (the reference reads
# the weights with from_pretrained) check every weight, not only the final norm the first loss shows
CASES = {"llama-tp-pp-whole": ("llama", {"tp": 2, "pp": 2, "micro_batches": 2}, False),
         "mixtral-ep-zero3-whole": ("mixtral", {"dp": 4, "ep": 2, "zero_stage": 3}, False),
         "mixtral-ep-zero3-shards": ("mixtral", {"dp": 4, "ep": 2, "zero_stage": 3}, True),
         "llama-dp-tp-shards": ("llama", {"dp": 2, "tp": 2}, True),
         "llama-zero3-shards": ("llama", {"dp": 4, "zero_stage": 3}, True),
         "gpt2-tp-pp-shards": ("gpt2", {"tp": 2, "pp": 2, "micro_batches": 2}, True),
         "gpt2-zero3-pp-shards": ("gpt2", {"dp": 2, "zero_stage": 3, "pp": 2, "micro_batches": 2}, True),
         "llama-config-weights-tp-whole": ("llama-config", {"dp": 2, "tp": 2}, False),
         "llama-config-weights-zero3-pp-shards": ("llama-config", {"dp": 2, "zero_stage": 3, "pp": 2,
                                                                   "micro_batches": 2}, True)}


@pytest.fixture(scope="module")
def reports(saved):
    from autopar_nb.verify import verify_many

    cases, metas = [], []
    for kind, fix, meta in CASES.values():
        src = _case_source(saved, kind)
        model, inputs, _ = src.build(device="meta")
        cases.append((src, ap.plan(ap.capture(model, inputs), ap.Cluster.preset("cpu", 1, 4), global_batch=8,
                                   fix=fix)))
        metas.append(meta)
    return dict(zip(CASES, verify_many(cases, steps=2, meta_init=metas), strict=True))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", CASES)
def test_training_starts_from_the_pretrained_weights(reports, name):
    report = reports[name]
    print(report)
    assert report.ok, report
    assert report.steps[0].loss == pytest.approx(math.log(VOCAB), rel=1e-6)  # the saved weights, on every rank


def _save_hf(checkpoint: str, tmp_path, nproc: int, fix: dict) -> None:
    """Plan the checkpoint's cell with ``fix`` on ``nproc`` CPU ranks, export it (meta_init: shards read after
    parallelize) and run the script for no step with ``--save-hf tmp_path/out``."""
    import subprocess
    import sys

    src = _source(checkpoint)
    model, inputs, _ = src.build(device="meta")
    plan = ap.plan(ap.capture(model, inputs), ap.Cluster.preset("cpu", 1, nproc), global_batch=8, fix=fix)
    script = ap.export(src, plan, tmp_path / "train.py", meta_init=True, quiet=True).script
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(script), "--steps", "0", "--save-hf", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.multiprocess
def test_saved_weights_are_what_from_pretrained_reads(saved, tmp_path):
    """The exported script's ``--save-hf``: every rank's shards (tp x pp, GPT-2's tied head and fused [q|k|v],
    read shard by shard) written back as one Hugging Face checkpoint that ``from_pretrained`` reads, equal to the
    one read (no step taken)."""
    from transformers import GPT2LMHeadModel

    _save_hf(saved["gpt2"], tmp_path, 4, {"tp": 2, "pp": 2, "micro_batches": 2})
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    before = GPT2LMHeadModel.from_pretrained(saved["gpt2"]).state_dict()
    after = GPT2LMHeadModel.from_pretrained(tmp_path / "out").state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.equal(value, after[key]), key


@pytest.mark.multiprocess
def test_saved_mixtral_reads_back_with_the_same_logits(saved, tmp_path):
    """``--save-hf`` of Mixtral (experts split by EP, sharded by FSDP) writes the model's own names (stacked
    ``mlp.experts.gate_up_proj``), not the checkpoint's one-by-one ``block_sparse_moe.experts.N.w1``; transformers'
    ``from_pretrained`` (5.x: a name already the model's is not converted) reads them back, to the same logits."""
    from safetensors import safe_open
    from transformers import MixtralForCausalLM

    _save_hf(saved["mixtral"], tmp_path, 2, {"dp": 2, "ep": 2, "zero_stage": 3})
    with safe_open(str(tmp_path / "out" / "model-00001-of-00001.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in set(f.keys())
    before, after = (MixtralForCausalLM.from_pretrained(path).eval() for path in (saved["mixtral"], tmp_path / "out"))
    assert before.state_dict().keys() == after.state_dict().keys()
    for key, value in before.state_dict().items():
        assert torch.equal(value, after.state_dict()[key]), key
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for m in (before, after):
            m.model.norm.weight.fill_(1.0)  # saved as zeros (the loss test's log(vocab)): the logits would be too
        assert before(tokens).logits.abs().sum() > 0
        # the weights are equal (above), but each file puts them at other offsets, so the loaded tensors' memory
        # alignment differs and the CPU's GEMM kernels may round one unit apart (1.5e-7 of logits up to 0.7 seen)
        torch.testing.assert_close(after(tokens).logits, before(tokens).logits, rtol=1e-6, atol=1e-6)
        assert after.config.use_cache == before.config.use_cache  # the script switched it off to train
