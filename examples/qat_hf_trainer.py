"""Quantization-aware training with ``transformers.Trainer``, then a checked ExecuTorch ``.pte`` that generates.

    python examples/qat_hf_trainer.py [OUT_DIR]        # default OUT_DIR: runs/qat_hf_trainer

A tiny Llama (random init) and a BPE tokenizer are built here from text that ships with Python, so the example runs
offline; put your own ``AutoModelForCausalLM`` and tokenizer in their place. ``qharness.prepare`` gives a module the
Trainer trains as it would the HF model (``forward(input_ids, labels)`` returns ``.loss``), with the recipe's fake
quantization in every step. Trainer checkpoints go to ``OUT_DIR/trainer``; run the script again (e.g. after an
interruption) and ``trainer.train(resume_from_checkpoint=...)`` continues from the last one.
"""

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import qharness
from qharness.sources.text import embedded_corpus, tokenize_stream
from qharness.sources.tokenizer import train_bpe_tokenizer

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/qat_hf_trainer")
BATCH, SEQ = 4, 32  # the prepared graph is exported for [BATCH, SEQ] input_ids: every batch must have this shape

# a tiny causal LM and its tokenizer (your AutoModelForCausalLM.from_pretrained(...) and AutoTokenizer go here)
text = "\n\n".join(embedded_corpus(200_000))
tokenizer = train_bpe_tokenizer([text], vocab_size=384)
config = LlamaConfig(
    vocab_size=len(tokenizer),
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    bos_token_id=tokenizer.bos_token_id,
    eos_token_id=tokenizer.eos_token_id,
    pad_token_id=tokenizer.pad_token_id,
)
torch.manual_seed(0)
model = LlamaForCausalLM(config)

# the text as one token stream cut into [SEQ]-token blocks; its last 16 blocks' tokens are held out (evaluation, and
# the .pte's parity gate)
stream = tokenize_stream([text], tokenizer)
train_stream, val_stream = stream[: -16 * SEQ], stream[-16 * SEQ :]
train_blocks = train_stream[: len(train_stream) // SEQ * SEQ].view(-1, SEQ)
train_data = [{"input_ids": b, "labels": b} for b in train_blocks]  # labels as for any HF causal LM (shifted inside)
val_data = [{"input_ids": b, "labels": b} for b in val_stream.view(-1, SEQ)]

args = TrainingArguments(
    output_dir=str(OUT / "trainer"),
    max_steps=8,
    save_steps=4,
    eval_strategy="steps",
    eval_steps=4,
    per_device_train_batch_size=BATCH,
    per_device_eval_batch_size=BATCH,
    dataloader_drop_last=True,  # a last, smaller batch would not fit the exported shape
    learning_rate=1e-3,
    warmup_steps=2,
    logging_steps=2,
    report_to="none",
    use_cpu=True,
    seed=0,
)

# the Trainer's device is where the exported graph must live: prepare the model there
qmodel = qharness.prepare(
    model.to(args.device), "xnnpack_int8_dynamic", batch_size=BATCH, seq_len=SEQ, tokenizer=tokenizer
)
trainer = Trainer(model=qmodel, args=args, train_dataset=train_data, eval_dataset=val_data)
last = get_last_checkpoint(args.output_dir) if Path(args.output_dir).is_dir() else None
trainer.train(resume_from_checkpoint=last)  # None: from the start; else the weights, optimizer, schedule and step
print(f"trained to step {trainer.state.global_step}" + (f" (resumed from {last})" if last else ""))

# the trained fake-quant model -> a .pte with a static KV cache, checked against the converted model
result = qharness.export(
    qmodel, OUT, tokenizer=tokenizer, calibration=train_blocks[:8], validation=val_stream, max_seq_len=64
)
print(f"{result.pte_path}: {result.size_bytes / 1e6:.2f} MB, parity passed: {result.parity.passed}")

pte = qharness.Pte.load(result.pte_path)
print(pte.generate("def main():", max_new_tokens=16))
