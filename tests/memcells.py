"""Hugging Face families of the models people bring (tests/families.py), at the sizes the memory checks use: the
same configs and default flags, widths and lengths as arguments (issue 21: hidden 256, 4 layers, seq 256,
batch 8)."""

from __future__ import annotations

_LM = """\
import torch
from transformers import {config}, {model}

config = {config}({args})
model = {model}(config)
example_inputs = (torch.randint(0, {vocab}, ({batch}, {seq})),)
"""
VOCAB = 1024
"""token table size of the language models (small beside the blocks, as in a real model's share)"""


def _lm(config: str, model: str, args: str):
    def cell(*, hidden: int, layers: int, seq: int, batch: int) -> str:
        a = args.format(h=hidden, ff=2 * hidden, L=layers, heads=max(hidden // 32, 4), kv=max(hidden // 64, 2),
                        pos=max(2 * seq, 64), vocab=VOCAB)
        return _LM.format(config=config, model=model, args=a, vocab=VOCAB, batch=batch, seq=seq)
    return cell


def _t5(*, hidden: int, layers: int, seq: int, batch: int) -> str:
    return f"""\
import torch
from transformers import T5Config, T5ForConditionalGeneration

config = T5Config(vocab_size={VOCAB}, d_model={hidden}, d_kv=32, d_ff={2 * hidden}, num_layers={layers},
                  num_heads={hidden // 32}, decoder_start_token_id=0)
model = T5ForConditionalGeneration(config)
example_inputs = {{"input_ids": torch.randint(0, {VOCAB}, ({batch}, {seq})),
                  "labels": torch.randint(0, {VOCAB}, ({batch}, {seq // 2}))}}
"""


def _vit(*, hidden: int, layers: int, seq: int, batch: int) -> str:
    side = 4 * int(round(seq ** 0.5))  # patches of 4 x 4: about `seq` tokens
    return f"""\
import torch
from transformers import ViTConfig, ViTForImageClassification

config = ViTConfig(image_size={side}, patch_size=4, hidden_size={hidden}, num_hidden_layers={layers},
                   num_attention_heads={hidden // 32}, intermediate_size={2 * hidden}, num_labels=10)
model = ViTForImageClassification(config)
example_inputs = {{"pixel_values": torch.randn({batch}, 3, {side}, {side}), "labels": torch.randint(0, 10, ({batch},))}}
"""


CELLS = {
    "GPT-2": _lm("GPT2Config", "GPT2LMHeadModel",
                 "vocab_size={vocab}, n_positions={pos}, n_embd={h}, n_layer={L}, n_head={heads}"),
    "LLaMA": _lm("LlamaConfig", "LlamaForCausalLM",
                 "vocab_size={vocab}, hidden_size={h}, intermediate_size={ff}, num_hidden_layers={L}, "
                 "num_attention_heads={heads}, num_key_value_heads={kv}, max_position_embeddings={pos}"),
    "Qwen2": _lm("Qwen2Config", "Qwen2ForCausalLM",
                 "vocab_size={vocab}, hidden_size={h}, intermediate_size={ff}, num_hidden_layers={L}, "
                 "num_attention_heads={heads}, num_key_value_heads={kv}, max_position_embeddings={pos}"),
    "GPT-NeoX": _lm("GPTNeoXConfig", "GPTNeoXForCausalLM",
                    "vocab_size={vocab}, hidden_size={h}, intermediate_size={ff}, num_hidden_layers={L}, "
                    "num_attention_heads={heads}, max_position_embeddings={pos}"),
    "BERT": _lm("BertConfig", "BertForMaskedLM",
                "vocab_size={vocab}, hidden_size={h}, num_hidden_layers={L}, num_attention_heads={heads}, "
                "intermediate_size={ff}, max_position_embeddings={pos}"),
    "T5": _t5,
    "ViT": _vit,
    "Mixtral": _lm("MixtralConfig", "MixtralForCausalLM",
                   "vocab_size={vocab}, hidden_size={h}, intermediate_size={ff}, num_hidden_layers={L}, "
                   "num_attention_heads={heads}, num_key_value_heads={kv}, num_local_experts=4, "
                   "num_experts_per_tok=2, max_position_embeddings={pos}"),
}
"""family -> cell(hidden=, layers=, seq=, batch=) -> the cell's source"""
