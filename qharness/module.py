"""The LightningModule that trains (QAT) or calibrates (PTQ) a PT2E-prepared exported graph.

Stages: ``export_for_training`` (logits-only wrapper -> ``torch.export`` pre-dispatch graph) ->
``prepare_for_training`` (the recipe's quantizer: ``prepare_qat_pt2e``/``prepare_pt2e``, or torchao QAT
modules for source-level recipes) -> ``QuantLM`` trains it.

Exported graphs ignore ``.train()/.eval()``; the validation/test hooks below switch them with
``move_exported_model_to_train/eval`` and freeze static observers so validation never moves
quantization ranges (dynamic-activation fake-quants keep observing: that *is* dynamic quantization).
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F

from qharness import compat
from qharness.errors import UserError
from qharness.recipes import load_recipe


class LogitsOnly(torch.nn.Module):
    """``input_ids -> logits`` with no KV cache, the form that is trained."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def export_for_training(model, batch_size: int, seq_len: int) -> torch.fx.GraphModule:
    """Pre-dispatch ATen graph (autograd-safe) of the logits-only model, static ``[batch_size, seq_len]``."""
    example = torch.zeros(batch_size, seq_len, dtype=torch.long)
    return torch.export.export(LogitsOnly(model).eval(), (example,)).module()


def prepare_for_training(model, recipe, batch_size: int, seq_len: int, is_qat: bool) -> torch.fx.GraphModule:
    """Export the model and insert the recipe's fake-quant (QAT) or observers (PTQ).

    PT2E recipes annotate the exported graph (``prepare_qat_pt2e`` / ``prepare_pt2e``); source-level
    recipes (torchao ``quantize_``) swap in fake-quantized modules first and export the result.
    """
    from qharness.recipes import SourceQuantizer

    quantizer = recipe.make_quantizer(is_qat=is_qat)
    if isinstance(quantizer, SourceQuantizer):
        if is_qat:
            quantizer.prepare_qat(model)
        return export_for_training(model, batch_size, seq_len)
    graph = export_for_training(model, batch_size, seq_len)
    if quantizer is None:
        return graph
    pt2e = compat.pt2e()
    return (pt2e.prepare_qat_pt2e if is_qat else pt2e.prepare_pt2e)(graph, quantizer)


def set_static_observers(graph: torch.nn.Module, enabled: bool) -> None:
    """Enable/disable observers of static fake-quants (weights, static activations)."""
    pt2e = compat.pt2e()
    for m in graph.modules():
        if isinstance(m, pt2e.FakeQuantizeBase) and not getattr(m, "is_dynamic", False):
            (m.enable_observer if enabled else m.disable_observer)()


class QuantLM(L.LightningModule):
    def __init__(
        self,
        checkpoint: str = "embedded",
        recipe: str = "xnnpack_int8_dynamic",
        mode: str = "qat",
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 10,
        trust_remote_code: bool = False,
    ):
        """A causal LM trained with quantization-aware training (or calibrated) for one backend recipe.

        Args:
            checkpoint: ``embedded`` (the built-in small Llama, pretrained on first use), a local
                ``save_pretrained`` directory of any decoder-only HF causal LM that transformers exports
                with a static KV cache (Llama, Qwen2/3, Mistral, Phi-3, Gemma 1/2/3, ...), a hub id (online
                only), or a torchtune builder: ``torchtune:llama3_2.llama3_2_1b`` or
                ``torchtune:llama3_2.llama3_2(vocab_size=2048, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=128, max_seq_len=512)``
                (random init; ``tokenizer=DIR`` picks an HF tokenizer; needs the torchtune extra).
            recipe: Backend recipe name (``qharness recipes`` lists them) or a path to a recipe YAML.
            mode: ``qat`` (train with fake quantization) or ``ptq`` (calibrate only).
            lr: Peak learning rate of AdamW.
            weight_decay: AdamW weight decay.
            warmup_steps: Linear warm-up steps before the cosine decay.
            trust_remote_code: Run model code from the hub (off by default; only for models you trust).
        """
        super().__init__()
        self.save_hyperparameters()
        self.recipe = load_recipe(recipe)
        self.recipe.check_mode(mode)
        if lr <= 0:
            raise UserError(f"model.lr must be positive (got {lr})")
        if warmup_steps < 0:
            raise UserError(f"model.warmup_steps must be >= 0 (got {warmup_steps})")
        if checkpoint != "embedded":
            from qharness.architectures import check_architecture
            from qharness.models import resolve_checkpoint

            # a missing directory, config or weights, or an architecture we cannot export, fails here, before any work
            check_architecture(resolve_checkpoint(checkpoint), trust_remote_code)
        self.graph: torch.fx.GraphModule | None = None
        self._val_losses: list[float] = []

    # --- building -------------------------------------------------------------------------------
    def model_source(self) -> str:
        from qharness.models import resolve_checkpoint

        return resolve_checkpoint(self.hparams.checkpoint)

    def load_fp(self):
        from qharness.models import load_model_and_tokenizer

        return load_model_and_tokenizer(self.model_source(), self.hparams.trust_remote_code)

    def build(self, batch_size: int, seq_len: int) -> None:
        """Load the FP model, export it and prepare it with the recipe (deterministic, so checkpoints load)."""
        if self.graph is not None:
            return
        model, _ = self.load_fp()
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if context is not None and seq_len > context:
            raise UserError(f"data.seq_len={seq_len} exceeds the model's context ({context})", fix=f"set data.seq_len <= {context}")
        graph = prepare_for_training(model, self.recipe, batch_size, seq_len, is_qat=self.hparams.mode == "qat")
        compat.pt2e().allow_train_eval(graph)
        self.graph = graph

    def configure_model(self) -> None:
        dm = self.trainer.datamodule
        self.build(dm.batch_size, dm.seq_len)

    def trained_weights(self) -> dict[str, torch.Tensor]:
        """The trained FP weights keyed by the HF model's parameter names (tied weights under each name)."""
        return {k[len("model.") :]: v.detach() for k, v in self.graph.named_parameters(remove_duplicate=False)}

    def load_into(self, hf_model) -> None:
        """Copy the trained weights into an HF model of the same architecture.

        Tied parameters (one tensor under several names, e.g. embeddings and lm_head) may appear
        under any one of their names in the graph.
        """
        weights = self.trained_weights()
        groups: dict[int, list[str]] = {}
        for name, p in hf_model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
        missing = [names for names in groups.values() if not any(n in weights for n in names)]
        extra = set(weights) - {n for names in groups.values() for n in names}
        if missing or extra:
            raise RuntimeError(f"trained graph and model disagree: missing {missing[:5]}, extra {sorted(extra)[:5]}")
        with torch.no_grad():
            for names in groups.values():
                hf_model.get_parameter(names[0]).copy_(weights[next(n for n in names if n in weights)])

    # --- modes ----------------------------------------------------------------------------------
    def _to_eval(self) -> None:
        compat.pt2e().move_to_eval(self.graph)
        set_static_observers(self.graph, enabled=False)

    def _to_train(self) -> None:
        compat.pt2e().move_to_train(self.graph)
        set_static_observers(self.graph, enabled=True)

    def on_fit_start(self) -> None:
        self._to_train()

    on_validation_model_eval = _to_eval
    on_validation_model_train = _to_train
    on_test_model_eval = _to_eval
    on_test_model_train = _to_train
    on_predict_model_eval = _to_eval

    # --- steps ----------------------------------------------------------------------------------
    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.graph(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"training loss became {loss.item()} at step {self.global_step}; stopping "
                "(the last checkpoint is kept: lower model.lr or check the data)"
            )
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def optimizer_step(self, *args, **kwargs):
        """Stop before a diverged step reaches a checkpoint: NaN/inf weights end the run (last good one kept)."""
        super().optimizer_step(*args, **kwargs)
        bad = next((n for n, p in self.graph.named_parameters() if not torch.isfinite(p).all()), None)
        if bad is not None:
            raise FloatingPointError(
                f"training diverged at step {self.global_step}: {bad} became NaN/inf; stopping "
                "(the last checkpoint is kept: lower model.lr or check the data)"
            )

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self._val_losses.append(loss.item())
        self.log("val/loss", loss, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        if self._val_losses:
            mean = sum(self._val_losses) / len(self._val_losses)
            self.log("val/ppl", math.exp(min(mean, 50.0)))
        self._val_losses = []

    test_step = validation_step
    on_test_epoch_end = on_validation_epoch_end

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.graph.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warm = self.hparams.warmup_steps

        def schedule(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            progress = min(1.0, (step - warm) / max(1, total - warm))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule), "interval": "step"}}
