"""Quantization-aware training in your own ``LightningModule`` with ``qharness.QuantizationCallback``.

    python examples/qat_lightning.py [OUT_DIR]         # default OUT_DIR: runs/qat_lightning

Your module holds an HF causal LM (``self.model``) and trains it as usual; the callback replaces ``self.model`` by
qharness's fake-quantized model at ``setup`` (before your optimizer is built and before a checkpoint is restored),
keeps it through validation and checkpoints, and exports the ``.pte`` with the parity gate after fit
(``callback.result``). Checkpoints go to ``OUT_DIR/checkpoints``; run the script again (e.g. after an interruption
or a SIGTERM, which saves ``last.ckpt``) and ``trainer.fit(..., ckpt_path="last")`` resumes from the last one.
"""

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

import qharness
from qharness.sources.text import embedded_corpus, tokenize_stream
from qharness.sources.tokenizer import train_bpe_tokenizer

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/qat_lightning")
BATCH, SEQ = 4, 32  # the prepared graph is exported for [BATCH, SEQ] input_ids: every batch must have this shape


class CausalLM(L.LightningModule):
    """Your own module: an HF causal LM trained on token blocks (nothing here knows about quantization)."""

    def __init__(self, model, lr: float = 1e-3):
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.model(input_ids=batch, labels=batch).loss, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)


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
module = CausalLM(LlamaForCausalLM(config))

# the text as [SEQ]-token blocks: the last 16 held out (validation, and the .pte's parity gate)
stream = tokenize_stream([text], tokenizer)
blocks = stream[: len(stream) // SEQ * SEQ].view(-1, SEQ)
train = DataLoader(blocks[:-16], batch_size=BATCH, shuffle=True, drop_last=True)  # drop_last: one static shape
val = DataLoader(blocks[-16:], batch_size=BATCH, drop_last=True)

quantization = qharness.QuantizationCallback(
    "xnnpack_int8_dynamic", batch_size=BATCH, seq_len=SEQ, tokenizer=tokenizer, max_seq_len=64
)  # the .pte goes to the trainer's default_root_dir; calibration and parity blocks come from its dataloaders
trainer = L.Trainer(
    default_root_dir=OUT,
    max_steps=8,
    val_check_interval=4,
    limit_val_batches=2,
    accelerator="cpu",
    logger=False,
    enable_progress_bar=False,
    callbacks=[quantization, ModelCheckpoint(dirpath=OUT / "checkpoints", every_n_train_steps=4, save_last=True)],
)
L.seed_everything(0)
resume = "last" if (OUT / "checkpoints" / "last.ckpt").is_file() else None
trainer.fit(module, train, val, ckpt_path=resume)  # "last": the weights, observers, optimizer and step of last.ckpt
print(f"trained to step {trainer.global_step}" + (" (resumed from last.ckpt)" if resume else ""))

result = quantization.result
print(f"{result.pte_path}: {result.size_bytes / 1e6:.2f} MB, parity passed: {result.parity.passed}")
print(qharness.Pte.load(result.pte_path).generate("def main():", max_new_tokens=16))
