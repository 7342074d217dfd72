"""PTQ: prepare -> calibrate on your batches -> export a checked .pte -> generate. No training.

Runs offline on a CPU: a tiny random-init Llama and a BPE tokenizer trained on text shipped with Python. Swap in
your own model and data (``AutoModelForCausalLM.from_pretrained(...)``, your tokenizer and text).

    python examples/ptq.py [OUT_DIR]      # default: out/ptq
"""

import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import qharness
from qharness.sources.text import embedded_corpus
from qharness.sources.tokenizer import train_bpe_tokenizer

out_dir = sys.argv[1] if len(sys.argv) > 1 else "out/ptq"
text = "\n\n".join(embedded_corpus(300_000))
train_text, val_text = text[:250_000], text[250_000:]
tokenizer = train_bpe_tokenizer([train_text], vocab_size=384)
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=len(tokenizer),
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
model = AutoModelForCausalLM.from_config(config)

# 1. prepare for PTQ and calibrate on a few [8, 64] batches of your data
seq_len = 64
qm = qharness.prepare(model, "xnnpack_int8_dynamic", mode="ptq", batch_size=8, seq_len=seq_len, tokenizer=tokenizer)
ids = torch.tensor(tokenizer(train_text)["input_ids"])
batches = ids[: 4 * 8 * seq_len].view(4, 8, seq_len)
qm = qharness.calibrate(qm, batches)

# 2. export: static-KV-cache .pte, lowered for XNNPACK, checked against the converted model (parity gate)
result = qharness.export(qm, out_dir, validation=val_text, parity={"eval_blocks": 8})
print(f"{result.pte_path}: {result.size_bytes / 1e6:.2f} MB, parity passed: {result.parity.passed}")

# 3. run the .pte with the ExecuTorch runtime
pte = qharness.Pte.load(result.pte_path)
print(repr(pte.generate("def main():", max_new_tokens=16)))
