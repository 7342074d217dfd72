"""``QuantizationCallback``: qharness QAT inside your own ``LightningModule``.

What Lightning 1.x's ``QuantizationAwareTraining`` callback was (removed in 2.0), done for torch.export / PT2E /
ExecuTorch: at ``setup`` (before ``configure_optimizers`` and before a checkpoint is restored) the HF causal LM your
module holds is replaced by ``qharness.prepare(...)``'s fake-quantized model, so your ``training_step`` trains it and
your optimizer sees its parameters; checkpoints hold the prepared state and ``trainer.fit(..., ckpt_path=...)``
resumes into it; after fit the ``.pte`` is exported with the parity gate (``qharness.export``) and its
``ExportResult`` is kept on the callback. Checkpoints are written atomically and SIGTERM saves ``last.ckpt``, as in
``qharness fit``.

Example::

    cb = QuantizationCallback("xnnpack_int8_dynamic", batch_size=4, seq_len=32, tokenizer=tok)
    trainer = lightning.Trainer(max_steps=100, callbacks=[cb])
    trainer.fit(my_module, train_loader, val_loader)     # my_module.model: an AutoModelForCausalLM
    print(cb.result.pte_path, cb.result.parity)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from qharness.errors import UserError

log = logging.getLogger("qharness")


class QuantizationCallback(Callback):
    """Quantization-aware training of the HF causal LM at ``pl_module.<attr>``, then a ``.pte``. (PTQ trains
    nothing: ``qharness.prepare(model, recipe, mode="ptq", ...)``, ``qharness.calibrate``, ``qharness.export``.)

    Args:
        recipe: A recipe name (``qharness.list_recipes()`` lists them), a recipe YAML path or a loaded ``Recipe``.
        batch_size: The training batch size: the prepared graph is exported for ``[batch_size, seq_len]``
            ``input_ids`` (use ``drop_last=True`` so every batch has it).
        seq_len: Tokens per training block.
        out_dir: Where the ``.pte``, the tokenizer and ``summary.json`` go (default: ``trainer.default_root_dir``).
        attr: The attribute of your LightningModule holding the HF model (``self.model`` by default).
        tokenizer: The model's tokenizer (written beside the ``.pte`` for its runner; the parity prompts use it).
        calibration: The deploy graph's calibration data as ``qharness.export`` takes it (text, a token stream or
            ``[m, seq_len]`` blocks); None: the first ``calibration_blocks`` blocks of the trainer's training dataloader.
        validation: The parity gate's held-out data as ``qharness.export`` takes it (text or a token stream); None:
            the first ``validation_blocks`` blocks of the trainer's validation dataloader (else the training one).
        calibration_blocks: How many blocks to take when ``calibration`` is None.
        validation_blocks: How many blocks to take when ``validation`` is None.
        max_seq_len: KV-cache length of the ``.pte`` (None: ``qharness.export``'s default).
        parity: The parity gate's settings (``qharness.export``'s ``parity``; None: its defaults).
        export: Export the ``.pte`` after fit (rank 0). False: only train.
        save_on_sigterm: On SIGTERM save ``last.ckpt`` (in the ``ModelCheckpoint`` directory) at the batch boundary.

    After ``trainer.fit``: ``result`` is the ``ExportResult`` (``pte_path``, ``size_bytes``, ``parity``, ...).
    """

    def __init__(
        self,
        recipe,
        batch_size: int,
        seq_len: int,
        *,
        out_dir: str | os.PathLike | None = None,
        attr: str = "model",
        tokenizer=None,
        calibration=None,
        validation=None,
        calibration_blocks: int = 32,
        validation_blocks: int = 8,
        max_seq_len: int | None = None,
        parity=None,
        export: bool = True,
        save_on_sigterm: bool = True,
    ):
        for name, value in (
            ("batch_size", batch_size),
            ("seq_len", seq_len),
            ("calibration_blocks", calibration_blocks),
            ("validation_blocks", validation_blocks),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(
                    f"QuantizationCallback {name}={value!r} must be a positive integer", fix=f"e.g. {name}=4"
                )
        if not isinstance(attr, str) or not attr.isidentifier():
            raise UserError(
                f"QuantizationCallback attr={attr!r} is not an attribute name",
                fix="pass the name of your LightningModule's attribute holding the HF model, e.g. attr='model'",
            )
        self.recipe, self.batch_size, self.seq_len = recipe, batch_size, seq_len
        self.out_dir, self.attr, self.tokenizer = out_dir, attr, tokenizer
        self.calibration, self.validation = calibration, validation
        self.calibration_blocks, self.validation_blocks = calibration_blocks, validation_blocks
        self.max_seq_len, self.parity = max_seq_len, parity
        self.export, self.save_on_sigterm = export, save_on_sigterm
        self.result = None  # the ExportResult, after fit
        self._recipe_name: str | None = None

    # --- preparing --------------------------------------------------------------------------------
    def prepared(self, pl_module):
        """The ``QuantizedModel`` at ``pl_module.<attr>`` (None before ``setup``)."""
        from qharness.api.prepare import QuantizedModel

        model = getattr(pl_module, self.attr, None)
        return model if isinstance(model, QuantizedModel) else None

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Replace ``pl_module.<attr>`` by the prepared model (once; a checkpoint is restored into it afterwards)."""
        self._install_checkpoint_io(trainer)
        if self.prepared(pl_module) is not None:
            return
        model = getattr(pl_module, self.attr, None)
        if model is None:
            raise UserError(
                f"QuantizationCallback(attr={self.attr!r}): {type(pl_module).__name__} has no attribute {self.attr!r} "
                "holding a model",
                fix=f"set self.{self.attr} = AutoModelForCausalLM... in your LightningModule's __init__, or pass "
                "attr=<the attribute that holds it>",
            )
        from qharness.api.prepare import check_causal_lm, prepare
        from qharness.api.recipes import load_recipe
        from qharness.schema.run import check_precision

        check_causal_lm(model, what=f"{type(pl_module).__name__}.{self.attr}")
        recipe = load_recipe(self.recipe)
        check_precision(trainer.precision, recipe, "qat")  # e.g. bf16-mixed with a torchao source-level recipe

        device = trainer.strategy.root_device  # the exported graph bakes its device in: prepare where it trains
        prepared = prepare(
            model.to(device),
            recipe,
            mode="qat",
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            tokenizer=self.tokenizer,
        )
        setattr(pl_module, self.attr, prepared)
        self._recipe_name = prepared.recipe.name  # a path or a Recipe object given: recorded by its name
        hook = pl_module.on_load_checkpoint  # called with a checkpoint to resume before its state is loaded

        def on_load_checkpoint(checkpoint: dict) -> None:
            self.check_checkpoint(checkpoint)
            hook(checkpoint)

        pl_module.on_load_checkpoint = on_load_checkpoint

    def _install_checkpoint_io(self, trainer) -> None:
        """Checkpoints written atomically (``AtomicCheckpointIO``), unless the user chose a checkpoint plugin."""
        from lightning.pytorch.plugins import TorchCheckpointIO

        from qharness.training.checkpoints import AtomicCheckpointIO

        strategy = trainer.strategy
        current = getattr(strategy, "_checkpoint_io", None)
        if current is None or type(current) is TorchCheckpointIO:
            strategy.checkpoint_io = AtomicCheckpointIO()

    # --- training ---------------------------------------------------------------------------------
    def on_validation_end(self, trainer, pl_module) -> None:
        """Back to the training graph after validation during fit: Lightning restores modes by setting ``.training``
        flags, which does not switch an exported graph (it would train in its eval form)."""
        prepared = self.prepared(pl_module)
        if prepared is not None and trainer.state.fn == "fit":
            prepared.train(True)

    def on_exception(self, trainer, pl_module, exception) -> None:
        """SIGTERM (a scheduler's pre-emption): ``last.ckpt`` saved at the batch boundary (``SaveOnSigterm``)."""
        if not self.save_on_sigterm:
            return
        from qharness.training.checkpoints import SaveOnSigterm

        SaveOnSigterm(self.checkpoint_dir(trainer) / "last.ckpt").on_exception(trainer, pl_module, exception)

    def checkpoint_dir(self, trainer) -> Path:
        """The ``ModelCheckpoint``'s directory, else ``<default_root_dir>/checkpoints``."""
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and getattr(ckpt, "dirpath", None):
            return Path(ckpt.dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"

    # --- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        given = str(self.recipe) if isinstance(self.recipe, (str, os.PathLike)) else self.recipe.name
        name = self._recipe_name or given  # the recipe's name once prepared
        return {"recipe": name, "shape": [self.batch_size, self.seq_len]}

    def check_checkpoint(self, checkpoint: dict) -> None:
        """Resuming: the checkpoint must have been trained with this callback's recipe and shape (one line, before
        Lightning loads its state into the prepared model, where a mismatch would end in a traceback)."""
        if "callbacks" not in checkpoint:  # a weights-only checkpoint: nothing recorded to check
            return
        saved = checkpoint["callbacks"].get(self.state_key)
        if not isinstance(saved, dict):
            raise UserError(
                "the checkpoint to resume was not trained with QuantizationCallback (it holds no prepared state)",
                fix="to start QAT from fine-tuned weights, load them into your model before fit; ckpt_path resumes a "
                "run trained with the callback",
            )
        for key, value in self.state_dict().items():
            if saved.get(key) != value:
                raise UserError(
                    f"the checkpoint was trained with QuantizationCallback {key}={saved.get(key)!r}, this callback has "
                    f"{value!r}",
                    fix="resume with the callback settings the checkpoint was trained with, or start a new run",
                )

    # --- after fit --------------------------------------------------------------------------------
    def on_fit_end(self, trainer, pl_module) -> None:
        """Export the trained model to a ``.pte`` with the parity gate (global rank 0); ``result`` holds it."""
        prepared = self.prepared(pl_module)
        if not self.export or prepared is None or trainer.interrupted or not trainer.is_global_zero:
            return
        from qharness.api.export import export

        calibration = self.calibration
        if calibration is None:
            calibration = blocks_of(trainer.train_dataloader, self.calibration_blocks)
        validation = self.validation
        if validation is None:
            blocks = blocks_of(trainer.val_dataloaders, self.validation_blocks)
            if blocks is None:
                blocks = blocks_of(trainer.train_dataloader, self.validation_blocks)
            validation = None if blocks is None else blocks.flatten()  # a token stream: export cuts input/target blocks
        prepared.train(False)
        self.result = export(
            prepared,
            Path(self.out_dir if self.out_dir is not None else trainer.default_root_dir),
            tokenizer=self.tokenizer,
            calibration=calibration,
            validation=validation,
            max_seq_len=self.max_seq_len,
            parity=self.parity,
        )


def input_ids_of(batch) -> torch.Tensor | None:
    """The ``input_ids`` of a batch as dataloaders give them: a dict/``BatchEncoding`` (``input_ids``), a tuple or
    list (its first element) or a tensor; None when there is none."""
    if isinstance(batch, torch.Tensor):
        return batch
    if hasattr(batch, "keys") and "input_ids" in batch.keys():
        return batch["input_ids"]
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    return None


def blocks_of(loaders, n: int) -> torch.Tensor | None:
    """The first ``n`` ``input_ids`` rows of a dataloader (or of the first of a list of them), on CPU; None when
    there is none."""
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    if loaders is None:
        return None
    rows, have = [], 0
    for batch in loaders:
        ids = input_ids_of(batch)
        if ids is None:
            return None
        rows.append(ids.detach().cpu())
        have += len(ids)
        if have >= n:
            break
    return torch.cat(rows)[:n] if rows else None
