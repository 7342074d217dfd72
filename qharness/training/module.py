"""The LightningModule that trains (QAT) or calibrates (PTQ) a PT2E-prepared exported graph.

The graph comes from ``training/prepare.py`` (``export_for_training`` -> ``prepare_for_training``); the teacher of
distillation from ``training/teacher.py``, its loss from ``training/losses.py``, the optimizer and schedule from
``training/optim.py``; weights go back into the HF model through ``training/weights.py``.

Exported graphs ignore ``.train()/.eval()``; the validation/test hooks below switch them with torchao's
``move_exported_model_to_train/eval`` (``upstream/pt2e_modes.py``: without re-tracing where nothing changes) and
freeze static observers so validation never moves quantization ranges (dynamic-activation fake-quants keep
observing: that *is* dynamic quantization).

Why ~400 lines: one class that Lightning drives, its hooks and the accessors deployment reads (``trained_weights``,
``learned_qparams``, ``lora_summary``) all methods of it; the work they call lives in the modules above.
"""

from __future__ import annotations

import math

import lightning as L
import torch

from qharness.errors import UserError
from qharness.schema.model import ModelConfig, check_layer_units
from qharness.sources.example_cache import IGNORE
from qharness.training.losses import distill_loss, token_loss
from qharness.training.optim import adamw_with_schedule
from qharness.training.prepare import LogitsOnly, prepare_for_training, set_fake_quant, set_static_observers
from qharness.training.teacher import load_teacher
from qharness.training.weights import hf_weights, load_weights_into, plain_tensors_to, state_on
from qharness.upstream import pt2e_modes


class QuantLM(L.LightningModule):
    def __init__(self, **fields):
        """A causal LM trained with quantization-aware training (or calibrated) for one backend recipe.

        Its fields are ``ModelConfig``'s (``qharness.schema.model``: types, defaults, help and rules in one place; the
        CLI's ``--model.*`` options are read from there), e.g. ``QuantLM(recipe="xnnpack_8da4w", lr=2e-4)``.
        """
        config = ModelConfig(**fields)  # checks every field (UserError naming it) before any work
        super().__init__()
        self.save_hyperparameters()
        self.hparams.update(config.hparams())  # every field, distill and lora as plain data (checkpoints)
        self.distill, self.lora = config.distill, config.lora
        self.recipe = config.load_recipe()
        if config.checkpoint not in ("embedded", "embedded-chat"):  # the built-in ones are built on first use
            from qharness.sources.models import resolve_checkpoint

            resolve_checkpoint(config.checkpoint)  # a missing directory, config or weights fails here, before any work
        self.graph: torch.nn.Module | None = None  # the prepared exported graph (eager modules for torchao QAT)
        # the distillation teacher, in a list so that it is no submodule: not in state_dict, checkpoints or the optimizer
        self._teacher: list[torch.nn.Module] = []
        self._val_losses: list[float] = []
        self.steps_trained: int | None = None  # optimizer steps behind the weights (set by fit and checkpoint loads)
        self._built_on = torch.device("cpu")  # where build exported the graph (graph_to_cpu re-exports it elsewhere)

    # --- building -------------------------------------------------------------------------------
    def model_source(self) -> str:
        from qharness.sources.models import resolve_checkpoint

        return resolve_checkpoint(self.hparams.checkpoint)

    def load_fp(self):
        """The FP model and tokenizer of ``model.checkpoint``; with a recipe's ``rotation``, its rotation folded into
        the weights (``recipes/rotation.py``: the same function, so every FP figure and the teacher stay the FP
        model's; every load rotates alike, so trained weights load into it)."""
        from qharness.sources.models import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(self.model_source(), self.hparams.trust_remote_code)
        if self.recipe.rotation is not None:
            from qharness.recipes.rotation import rotate

            rotate(model, self.recipe.rotation)
        return model, tokenizer

    def build(
        self, batch_size: int, seq_len: int, device: torch.device | str = "cpu", warm_start: torch.Tensor | None = None
    ) -> None:
        """Load the FP model, export it on ``device`` and prepare it with the recipe (deterministic, so
        checkpoints load). ``warm_start``: calibration blocks for a QAT recipe with ``rounding: gptq``, whose training
        starts from GPTQ's weights (and scales, when it learns them), or one that starts from what its PTQ would
        deploy (``recipe.starts_from_rounding``); not given where a checkpoint's state follows."""
        if self.graph is not None:
            return
        with torch.device("cpu"):  # loading and rounding run on CPU, also inside a trainer's GPU device context
            model, start_scales = self._load_and_round(warm_start)
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if context is not None and seq_len > context:
            raise UserError(
                f"data.seq_len={seq_len} exceeds the model's context ({context})", fix=f"set data.seq_len <= {context}"
            )
        graph = prepare_for_training(
            model.to(device),
            self.recipe,
            batch_size,
            seq_len,
            is_qat=self.hparams.mode == "qat",
            layerwise=self.hparams.layerwise,
            lora=self.lora,
        )
        if start_scales is not None and self.recipe.learns_scales:
            from qharness.recipes.learned_scales import start_source_scales

            start_source_scales(model, start_scales)
        if self.hparams.activation_checkpointing:
            from qharness.training.layerwise import set_checkpointing

            set_checkpointing(graph, True)
        self.graph = graph
        self._shape = (batch_size, seq_len)
        self._built_on = torch.device(device)

    def _load_and_round(self, warm_start: torch.Tensor | None):
        """The FP model, its weights rounded where QAT starts from a rounding (``qat_start``, GPTQ), and the scales
        training starts from (None: min-max, or a checkpoint's state follows)."""
        model, _ = self.load_fp()
        start_scales = None
        if self.hparams.mode == "qat" and self.recipe.starts_from_rounding:
            from qharness.recipes.rounding import qat_start

            scales = qat_start(model, self.recipe, warm_start)  # warm_start None: the structure a state loads into
            start_scales = scales if warm_start is not None else None
        if self.hparams.mode == "qat" and self.recipe.rounds_with_gptq:
            from qharness.recipes.gptq import gptq_round, untie_layers
            from qharness.sources.models import put_weights

            quantizer = self.recipe.make_quantizer(is_qat=False)
            untie_layers(model, quantizer)  # a tied lm_head trains as its own weight (deployment unties it anyway)
            if warm_start is not None:
                weights, start_scales = gptq_round(model, quantizer, warm_start)
                put_weights(model, weights)
        return model, start_scales

    def load_trained_state(self, state: dict, where: str) -> None:
        """``load_state_dict(state)``, a state of other names or shapes (another model, recipe or data layout) being
        one ``UserError`` line naming ``where`` (the checkpoint) and the first difference."""
        try:
            self.load_state_dict(state)
        except RuntimeError as e:
            first = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()), str(e).splitlines()[0])
            raise UserError(
                f"{where} does not fit this model: {first}",
                fix="use the config (model, recipe, data) the checkpoint was trained with",
            ) from e

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Resuming ``fit`` from a checkpoint: a state that does not fit the graph is one line (Lightning's own load
        would end in a traceback); the steps it was trained for are known."""
        from qharness.training.sharding import is_sharded

        if self.graph is not None and not is_sharded(self.graph):  # sharded graphs: the strategy loads its way
            self.load_trained_state(checkpoint["state_dict"], f"checkpoint {self.trainer.ckpt_path}")
        self.steps_trained = checkpoint.get("global_step")

    def configure_model(self) -> None:
        dm = self.trainer.datamodule
        strategy = self.trainer.strategy
        device = strategy.root_device  # e.g. cuda:<local rank>
        from qharness.training.sharding import is_model_parallel, shard

        sharded = is_model_parallel(strategy)
        if sharded:
            check_layer_units(
                self.recipe, self.hparams.layerwise, sharded_by=f"trainer.strategy {type(strategy).__name__}"
            )
        if self.graph is None:
            warm = None
            if (self.recipe.rounds_with_gptq or self.recipe.starts_from_rounding) and self.trainer.state.fn == "fit":
                from qharness.config import CalibrationConfig
                from qharness.training.calibration import calibration_blocks

                warm = calibration_blocks(getattr(self.trainer, "calibration_config", CalibrationConfig()), dm)
            self.build(dm.batch_size, dm.seq_len, device=device, warm_start=warm)
            if sharded:
                shard(self.graph, self.device_mesh["data_parallel"])
        if self.distill is not None and self.trainer.state.fn == "fit":  # training only, not validate/test
            self.teacher(device)

    def teacher(self, device: torch.device | str | None = None) -> torch.nn.Module:
        """The frozen FP teacher (``distill``): ``distill.teacher`` or else the model of ``model.checkpoint`` as
        loaded, eval mode, no gradients, on ``device`` (default: the student's). Built on first use from its source, on
        each rank; never saved."""
        if not self._teacher:
            if self.distill.teacher is None:
                model, _ = self.load_fp()
            else:
                model = load_teacher(self.distill.teacher, self.hparams.trust_remote_code)
            device = device or next(self.graph.parameters()).device
            self._teacher.append(LogitsOnly(model).to(device).eval().requires_grad_(False))
        return self._teacher[0]

    def gather(self) -> None:
        """After sharded training (every process calls it): global rank 0 holds the whole trained graph again, on CPU,
        unsharded (for deployment); the other processes drop theirs."""
        from qharness.training.sharding import full_state, is_sharded

        if self.graph is None or not is_sharded(self.graph):
            return
        state = full_state(self)
        if self.trainer.is_global_zero:
            self.rebuild_on("cpu", state)
        else:
            self.graph = None

    def graph_to_cpu(self) -> None:
        """Deployment runs on CPU. A graph exported on another device (its devices are baked in at export) is
        re-exported on CPU and given the trained state (weights and observers; the rebuild is deterministic), also
        when the trainer has already moved its state to CPU (Lightning's teardown does). Eager modules (torchao's
        source-level recipes) are moved, with the tensors ``.to()`` leaves behind (torchao's zero points)."""
        if self.graph is None:
            return
        from qharness.training.layerwise import graph_modules

        on_device = any(t.device.type != "cpu" for t in self.graph.state_dict().values())
        if on_device or (graph_modules(self.graph) and self._built_on.type != "cpu"):
            self.rebuild_on("cpu")
        else:
            self.graph.cpu()
            plain_tensors_to(self.graph, "cpu")

    def rebuild_on(self, device, state: dict[str, torch.Tensor] | None = None) -> None:
        """Export and prepare the graph again on ``device`` and load ``state`` (default: the current one) into it."""
        state = state_on(self.state_dict() if state is None else state, device)
        self.graph = None
        self.build(*self._shape, device=device)
        self.load_state_dict(state)

    def trained_weights(self) -> dict[str, torch.Tensor]:
        """The trained FP weights keyed by the HF model's parameter names (tied weights under each name); learned
        quantization scales are not weights (``learned_qparams``)."""
        from qharness.recipes.learned_scales import quantization_parameter_names

        scales = quantization_parameter_names(self.graph)
        weights = hf_weights(self.graph.named_parameters(remove_duplicate=False), skip=scales)
        if self.lora is not None:
            # LoRA: each adapted weight merged, W + s * B @ A, as the training forward computes it
            from qharness.training.lora import merge

            weights = merge(weights, self.lora.scale)
        return weights

    def lora_summary(self) -> dict | None:
        """LoRA-QAT: its settings, how many linear layers have adapters, and the trained vs all parameter elements
        (``summary.json``'s ``lora``); None without LoRA."""
        if self.lora is None:
            return None
        params = dict(self.graph.named_parameters()) if self.graph is not None else {}
        return {
            **self.lora.record(),
            "layers": sum(k.endswith(".lora_a") for k in params),
            "trained_parameters": sum(p.numel() for p in params.values() if p.requires_grad),
            "parameters": sum(p.numel() for p in params.values()),
        }

    def learned_qparams(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """QAT with learned scales: ``{HF weight name: (scale, zero_point)}`` as trained, for deployment to use
        (``recipes/learned_scales.py``); else None (deployment computes min-max scales)."""
        if self.hparams.mode != "qat" or not self.recipe.learns_scales:
            return None
        from qharness.recipes.learned_scales import learned_qparams
        from qharness.training.layerwise import graph_modules

        graphs = graph_modules(self.graph)
        if not graphs:  # eager modules (torchao source-level)
            return learned_qparams(self.graph, prefix="model.")
        return self._by_hf_name([(path, learned_qparams(graph)) for path, graph in graphs])

    def deploy_qparams(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """QAT: ``{HF weight name: (scale, zero_point)}`` that the trained graph quantizes its weights with, for the
        deployed program to use exactly: the learned scales (``learned_qparams``), or a PT2E graph's min-max scales as
        its weight fake-quants hold them (the weights they last observed, before the optimizer's last step, or where
        ``freeze_observers_after_n_steps`` froze them: ``graph_weight_qparams``). None otherwise (PTQ; torchao
        source-level fake quantizers compute min-max of the current weights, as deployment does; a graph whose weight
        fake-quants have observed nothing): deployment computes min-max scales of the trained weights."""
        if self.hparams.mode != "qat" or self.recipe.learns_scales:
            return self.learned_qparams()
        from qharness.training.layerwise import graph_modules
        from qharness.training.weights import graph_weight_qparams

        found = [(path, graph_weight_qparams(graph)) for path, graph in graph_modules(self.graph)]
        if not found or any(q is None for _, q in found):
            return None
        return self._by_hf_name(found) or None

    @staticmethod
    def _by_hf_name(found: list[tuple[str, dict]]) -> dict:
        """The qparams of each graph (``(path, {name in the graph: qparams})``) keyed by HF weight name."""
        from qharness.training.layerwise import hf_name

        out = {}
        for path, qparams in found:
            for name, q in qparams.items():
                out[hf_name(f"{path}.{name}" if path else name)] = q
        return {k[len("model.") :]: v for k, v in out.items()}

    def load_into(self, hf_model) -> None:
        """Copy the trained weights into an HF model of the same architecture (``load_weights_into``: tied weights
        trained apart are untied there too; a recipe that starts from rounding gives it its zero-point layers first)."""
        if self.hparams.mode == "qat" and self.recipe.starts_from_rounding:
            from qharness.recipes.rounding import qat_start

            qat_start(hf_model, self.recipe, None)
        load_weights_into(self.trained_weights(), hf_model)

    # --- modes ----------------------------------------------------------------------------------
    def fake_quant_on(self, step: int) -> bool:
        return step >= self.hparams.fake_quant_after_n_steps

    def observers_on(self, step: int) -> bool:
        n = self.hparams.freeze_observers_after_n_steps
        return n is None or step < n

    def to_eval(self) -> None:
        if isinstance(self.graph, torch.fx.GraphModule):
            pt2e_modes.move_to_eval(self.graph)
        else:  # eager torchao QAT modules
            self.graph.eval()
        set_static_observers(self.graph, enabled=False)

    def to_train(self) -> None:
        if isinstance(self.graph, torch.fx.GraphModule):
            pt2e_modes.move_to_train(self.graph)
        else:
            self.graph.train()
        set_static_observers(self.graph, enabled=self.observers_on(self.global_step))

    def on_fit_start(self) -> None:
        self.to_train()

    def on_fit_end(self) -> None:
        self._teacher.clear()  # deployment needs no teacher: its memory is free for export and lowering

    def on_train_batch_start(self, batch, batch_idx) -> None:
        """Fake quantization off before ``fake_quant_after_n_steps``; static observers frozen from
        ``freeze_observers_after_n_steps``. The switches are buffers, so checkpoints (and evaluation after
        training) keep the last training step's state."""
        hp = self.hparams
        if hp.mode == "qat" and (hp.fake_quant_after_n_steps or hp.freeze_observers_after_n_steps is not None):
            set_fake_quant(self.graph, self.fake_quant_on(self.global_step))
            set_static_observers(self.graph, enabled=self.observers_on(self.global_step))
            if (
                self.recipe.learns_scales
                and hp.fake_quant_after_n_steps
                and self.global_step == hp.fake_quant_after_n_steps
            ):
                from qharness.recipes.learned_scales import init_learned_scales
                from qharness.training.layerwise import graph_modules

                # learning starts from min-max of the weights FP training left
                for _, graph in graph_modules(self.graph):
                    init_learned_scales(graph)

    on_validation_model_eval = to_eval
    on_validation_model_train = to_train
    on_test_model_eval = to_eval
    on_test_model_train = to_train
    on_predict_model_eval = to_eval

    # --- steps ----------------------------------------------------------------------------------
    def loss(self, batch) -> torch.Tensor:
        """Cross-entropy of the graph's next-token predictions (validation and test; training without distill)."""
        x, y = batch
        return token_loss(self.forward_checked(x), y)

    def forward_checked(self, x: torch.Tensor) -> torch.Tensor:
        """``graph(x)``; activations that overflowed to NaN/inf stop the run with one line naming the step: torchao's
        observers assert on them (``min nan should be less than max nan``) before any loss could be checked."""
        try:
            return self.graph(x)
        except AssertionError as e:
            if "nan" not in str(e) and "inf" not in str(e):
                raise
            stage = "training" if self.training else "validation"
            raise FloatingPointError(
                f"training diverged at step {self.global_step}: the activations became NaN/inf during {stage} "
                f"(a quantization observer saw {str(e).strip()}); stopping, the last checkpoint is kept. "
                "fix: lower model.lr (or check the data) and resume from the last checkpoint or start again"
            ) from e

    def training_losses(self, batch) -> dict[str, torch.Tensor]:
        """``{"loss": ...}``; with ``distill`` also its parts ``ce`` (data labels) and ``kl`` (the teacher).

        Example::

            parts = module.training_losses((x, y))   # distill(kl_weight=1, hard_loss=False): parts["loss"] == parts["kl"]
        """
        d = self.distill
        if d is None:
            return {"loss": self.loss(batch)}
        x, y = batch
        logits = self.forward_checked(x)
        with torch.no_grad():
            target = self.teacher()(x)
        if target.shape != logits.shape:
            raise UserError(
                f"model.distill.teacher {d.teacher} gives logits of shape {tuple(target.shape)}, the student "
                f"{tuple(logits.shape)}",
                fix="distill from a model with the student's vocabulary (tokenizer)",
            )
        ce = token_loss(logits, y)
        kl = distill_loss(logits, target, d.temperature, y)  # chat data: the teacher matched on the answers only
        loss = d.kl_weight * kl + (ce if d.hard_loss else 0.0)
        return {"loss": loss, "ce": ce.detach(), "kl": kl.detach()}

    def training_step(self, batch, batch_idx):
        parts = self.training_losses(batch)
        loss = parts["loss"]
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"training diverged at step {self.global_step}: the training loss became {loss.item()}; stopping, "
                "the last checkpoint is kept. fix: lower model.lr (or check the data) and resume from the last "
                "checkpoint or start again"
            )
        self.log("train/loss", loss, prog_bar=True)
        for name in ("ce", "kl"):
            if name in parts:
                self.log(f"train/{name}", parts[name])
        return loss

    def optimizer_step(self, *args, **kwargs):
        """Stop before a diverged step reaches a checkpoint: NaN/inf weights end the run (last good one kept)."""
        super().optimizer_step(*args, **kwargs)
        bad = next((n for n, p in self.graph.named_parameters() if not torch.isfinite(p).all()), None)
        if bad is not None:
            raise FloatingPointError(
                f"training diverged at step {self.global_step}: {bad} became NaN/inf; stopping, the last checkpoint "
                "is kept. fix: lower model.lr (or check the data) and resume from the last checkpoint or start again"
            )

    def validation_step(self, batch, batch_idx):
        if not (batch[1] != IGNORE).any():
            return  # chat data: a batch without a trained target has no loss to average in
        loss = self.loss(batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"the validation loss became {loss.item()} at step {self.global_step} (batch {batch_idx}); stopping, "
                "the last checkpoint is kept. fix: lower model.lr (or check the data), or use an earlier checkpoint"
            )
        self._val_losses.append(loss.item())
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if self._val_losses:
            mean = sum(self._val_losses) / len(self._val_losses)
            self.log("val/ppl", math.exp(min(mean, 50.0)), sync_dist=True)
        self._val_losses = []

    test_step = validation_step
    on_test_epoch_end = on_validation_epoch_end

    def configure_optimizers(self):
        """AdamW with the warm-up + cosine schedule; learned quantization scales get no weight decay
        (``training/optim.py``)."""
        hp = self.hparams
        total = int(self.trainer.estimated_stepping_batches)
        return adamw_with_schedule(
            self.graph, hp.lr, hp.weight_decay, hp.warmup_steps, hp.min_lr_ratio, total, hp.scale_lr_ratio
        )
