"""QAT in a plain PyTorch loop: prepare -> train -> export a checked .pte -> generate.

Runs offline in about a minute on a CPU: a tiny random-init Llama and a BPE tokenizer trained on text shipped with
Python. Swap in your own model and data (``AutoModelForCausalLM.from_pretrained(...)``, your tokenizer and text).

    python examples/qat_plain_loop.py [OUT_DIR]      # default: out/qat_plain_loop
"""

import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import qharness
from qharness.sources.text import embedded_corpus
from qharness.sources.tokenizer import train_bpe_tokenizer

out_dir = sys.argv[1] if len(sys.argv) > 1 else "out/qat_plain_loop"
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

# 1. prepare: export + the recipe's fake quantization, a module that trains at the static shape [8, 64]
batch_size, seq_len = 8, 64
qm = qharness.prepare(model, "xnnpack_8da4w", batch_size=batch_size, seq_len=seq_len, tokenizer=tokenizer)

# 2. your loop: any optimizer, any schedule; the loss is the shifted cross-entropy (labels = input_ids)
ids = torch.tensor(tokenizer(train_text)["input_ids"])
blocks = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
optimizer = torch.optim.AdamW(qm.parameters(), lr=1e-3)
qm.train()
for step in range(20):
    batch = blocks[torch.randint(len(blocks), (batch_size,))]
    loss = qm(batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step % 5 == 0:
        print(f"step {step}: loss {loss.item():.3f}")

# 3. export: static-KV-cache .pte, lowered for XNNPACK, checked against the converted model (parity gate)
result = qharness.export(qm, out_dir, calibration=train_text, validation=val_text, parity={"eval_blocks": 8})
print(
    f"{result.pte_path}: {result.size_bytes / 1e6:.2f} MB, parity passed: {result.parity.passed}, "
    f"{result.coverage:.0%} of the weight bytes quantized"
)

# 4. run the .pte with the ExecuTorch runtime
pte = qharness.Pte.load(result.pte_path)
print(repr(pte.generate("def main():", max_new_tokens=16)))
