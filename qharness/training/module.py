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

from qharness.errors import UserError
from qharness.schema.model import LoRA, ModelConfig, check_layer_units
from qharness.sources.example_cache import IGNORE
from qharness.upstream import imports


class LogitsOnly(torch.nn.Module):
    """``input_ids -> logits`` with no KV cache, the form that is trained."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def load_teacher(source: str, trust_remote_code: bool = False):
    """The FP model of ``model.distill.teacher``: a ``model.checkpoint`` value, or the run directory of a ``qharness
    fit`` with an FP recipe, whose trained weights (``checkpoints/last.ckpt``, read ``weights_only``) are loaded
    into its source model. Example::

        teacher = load_teacher("runs/fp32_finetune-qat")   # the fine-tuned FP model, an HF causal LM
    """
    from qharness.schema.model import teacher_run_checkpoint
    from qharness.sources.models import load_model_and_tokenizer, resolve_checkpoint

    ckpt_path = teacher_run_checkpoint(source)
    if ckpt_path is None:
        return load_model_and_tokenizer(resolve_checkpoint(source), trust_remote_code)[0]
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    saved = ckpt.get("hyper_parameters", {}) if isinstance(ckpt, dict) else {}
    if "state_dict" not in ckpt or "recipe" not in saved:
        raise UserError(f"model.distill.teacher {ckpt_path} is not a qharness training checkpoint")
    check_finite_state(ckpt["state_dict"], f"model.distill.teacher {ckpt_path}")
    from qharness.recipes.registry import load_recipe

    recipe = load_recipe(saved["recipe"])
    if recipe.quantized or recipe.rotation is not None or saved.get("lora") is not None:
        raise UserError(
            f"model.distill.teacher {source} was trained with the quantized recipe {recipe.name!r}"
            if recipe.quantized
            else f"model.distill.teacher {source} was trained with a rotation or LoRA (recipe {recipe.name!r})",
            fix="use the run of a plain FP recipe (e.g. xnnpack_fp32_finetune) or a model directory",
        )
    graph = ((k[len("graph.") :], v) for k, v in ckpt["state_dict"].items() if k.startswith("graph."))
    model, _ = load_model_and_tokenizer(resolve_checkpoint(saved["checkpoint"]), trust_remote_code)
    load_weights_into(hf_weights(graph), model)
    return model


def check_finite_state(state: dict, where: str) -> None:
    """Refuse a state dict with a NaN anywhere, or an inf outside an observer's running min/max (which start at
    +-inf): a diverged run's weights would train, export or resume into NaN (``where`` names the file)."""
    for name, t in state.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        ok = ~torch.isnan(t) if name.endswith(("min_val", "max_val")) else torch.isfinite(t)
        if not bool(ok.all()):
            raise UserError(
                f"{where} holds NaN/inf values in {name} ({(~ok).sum().item()} of {t.numel()}): it was saved after "
                "training diverged",
                fix="use an earlier checkpoint (or train again with a lower model.lr)",
            )


def hf_weights(named_parameters, skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """A trained graph's ``model.*`` parameters (``(name, tensor)`` pairs, names as in the graph, ``skip`` left
    out) keyed by the HF model's parameter names, e.g. ``model.model.layers.0.mlp.up_proj.weight`` ->
    ``model.layers.0.mlp.up_proj.weight`` (layer-wise graphs' names mapped back with ``layerwise.hf_name``)."""
    from qharness.training.layerwise import hf_name

    return {
        hf_name(k)[len("model.") :]: v.detach() for k, v in named_parameters if k.startswith("model.") and k not in skip
    }


def load_weights_into(weights: dict[str, torch.Tensor], hf_model) -> None:
    """Copy ``weights`` (keyed by the HF model's parameter names) into ``hf_model``: every parameter must be given.

    Tied parameters (one tensor under several names, e.g. embeddings and lm_head) may appear under any one of their
    names; where training untied them (their values differ), they are untied in ``hf_model`` too.
    """
    from qharness.sources.models import parameter_names, put_weights

    groups = parameter_names(hf_model)
    missing = [names for names in groups if not any(n in weights for n in names)]
    extra = set(weights) - {n for names in groups for n in names}
    if missing or extra:
        raise RuntimeError(f"trained graph and model disagree: missing {missing[:5]}, extra {sorted(extra)[:5]}")
    untied = {}
    with torch.no_grad():
        for names in groups:
            given = [n for n in names if n in weights]
            if any(not torch.equal(weights[n], weights[given[0]]) for n in given[1:]):
                untied.update({n: weights[n] for n in given})  # trained apart (e.g. lm_head with GPTQ's warm start)
                continue
            hf_model.get_parameter(names[0]).copy_(weights[given[0]])
    if untied:
        put_weights(hf_model, untied)


def export_for_training(model, batch_size: int, seq_len: int) -> torch.fx.GraphModule:
    """Pre-dispatch ATen graph (autograd-safe) of the logits-only model, static ``[batch_size, seq_len]``,
    on the model's device (the graph bakes devices in: export where it will train)."""
    example = torch.zeros(batch_size, seq_len, dtype=torch.long, device=next(model.parameters()).device)
    return torch.export.export(LogitsOnly(model).eval(), (example,)).module()


def prepare_for_training(
    model, recipe, batch_size: int, seq_len: int, is_qat: bool, layerwise: bool = False, lora: LoRA | None = None
) -> torch.nn.Module:
    """Export the model and insert the recipe's fake-quant (QAT) or observers (PTQ).

    PT2E recipes annotate the exported graph (``prepare_qat_pt2e`` / ``prepare_pt2e``); source-level
    recipes (torchao ``quantize_``) swap in fake-quantized modules first and export the result.
    ``layerwise``: one graph per decoder layer (``training/layerwise.py``) instead of one for the whole model.
    ``lora`` (QAT): low-rank adapters on the target linears, fake-quantized merged with the frozen base weights
    (``training/lora.py``); everything but the adapters (and learned scales) is frozen.
    """
    root = _prepare(model, recipe, batch_size, seq_len, is_qat, layerwise, lora)
    if lora is not None:
        from qharness.recipes.learned_scales import quantization_parameter_names
        from qharness.training.layerwise import graph_modules
        from qharness.training.lora import check_merged_fake_quant, freeze_base

        freeze_base(root, keep=quantization_parameter_names(root))
        for _, graph in graph_modules(root):
            check_merged_fake_quant(graph)
    return root


def _prepare(model, recipe, batch_size, seq_len, is_qat, layerwise, lora) -> torch.nn.Module:
    if lora is not None and not is_qat:
        raise ValueError("LoRA adapters need QAT")
    quantizer = recipe.make_quantizer(is_qat=is_qat)
    if recipe.kind == "source":
        if is_qat:
            # torchao's fake quantizers pass gradients straight through in autograd.Functions, which
            # torch.export decomposes into round/clamp (zero gradient: nothing would train). Train the eager
            # modules instead; deployment re-exports the trained weights anyway.
            quantizer.prepare_qat(model)
            if lora is not None:  # onto torchao's FakeQuantizedLinear modules: their weight fake quantizer sees W + sBA
                from qharness.training.lora import add_adapters

                add_adapters(model, lora)
            if recipe.learns_scales:
                from qharness.recipes.learned_scales import init_source_scales

                init_source_scales(model)  # the scales are parameters before the optimizer (or a checkpoint) sees them
            return LogitsOnly(model).train()
        quantizer.check(model)  # the recipe's layers against this model now, not at deployment after calibration
        return export_for_training(model, batch_size, seq_len)

    def prepare(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
        pt2e = imports.pt2e()
        if quantizer is None:
            return pt2e.allow_train_eval(graph)
        prepared = (pt2e.prepare_qat_pt2e if is_qat else pt2e.prepare_pt2e)(graph, quantizer)
        if is_qat and recipe.learns_scales:
            from qharness.recipes.learned_scales import init_learned_scales

            init_learned_scales(prepared)  # the scales are parameters before the optimizer (or a checkpoint) sees them
        return pt2e.allow_train_eval(prepared)

    if lora is not None:  # before export: each linear's exported weight input is W + s * B @ A
        from qharness.training.lora import add_adapters

        add_adapters(model, lora)
    if layerwise:
        from qharness.training.layerwise import export_layerwise

        return LogitsOnly(export_layerwise(model, batch_size, seq_len, prepare))
    return prepare(export_for_training(model, batch_size, seq_len))


def _has_observed(fq) -> bool:
    """Whether a fake-quant's observer has seen data (its scale is computed); min/max start empty or inf."""
    obs = getattr(fq, "activation_post_process", None)
    lo = getattr(obs, "min_val", None)
    return lo is None or (lo.numel() > 0 and bool(torch.isfinite(lo).all()))


def set_static_observers(graph: torch.nn.Module, enabled: bool) -> None:
    """Enable/disable observers of static fake-quants (weights, static activations).

    One that has seen no data yet stays on (validation before the first training step, e.g. Lightning's
    sanity check, would otherwise run with an uncomputed scale).
    """
    pt2e = imports.pt2e()
    for m in graph.modules():
        if isinstance(m, pt2e.FakeQuantizeBase) and not getattr(m, "is_dynamic", False):
            (m.enable_observer if enabled or not _has_observed(m) else m.disable_observer)()


def set_fake_quant(graph: torch.nn.Module, enabled: bool) -> None:
    """Turn every PT2E fake-quant on or off. Off, the graph computes in floating point (observers still record).

    Example::

        set_fake_quant(prepared, False)   # prepared(x) == the exported FP graph's output
    """
    pt2e = imports.pt2e()
    for m in graph.modules():
        if isinstance(m, pt2e.FakeQuantizeBase):
            (m.enable_fake_quant if enabled else m.disable_fake_quant)()


def token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits[..., vocab]`` against ``y`` over the targets that count (not -100); 0 when none
    does (a block of chat data that is all prompt), where the mean would be NaN.

    Example::

        token_loss(logits, torch.full_like(y, -100))   # tensor(0.)
    """
    flat = y.flatten()
    total = F.cross_entropy(logits.flatten(0, 1), flat, ignore_index=IGNORE, reduction="sum")
    return total / (flat != IGNORE).sum().clamp(min=1)


def distill_loss(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float, y: torch.Tensor | None = None
) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher/T) || softmax(student/T))``, averaged over token positions; with the targets ``y``
    only over the positions whose target is trained (not -100: chat data's answers), 0 when there is none.

    ``student``/``teacher``: logits ``[..., vocab]`` (computed in float32). Example::

        distill_loss(s, s, 2.0)  # 0: identical distributions
    """
    student, teacher = student.flatten(0, -2), teacher.flatten(0, -2)
    if y is not None:
        keep = y.flatten() != IGNORE
        if not keep.all():
            student, teacher = student[keep], teacher[keep]
        if not len(student):
            return student.sum() * 0.0
    s = F.log_softmax(student.float() / temperature, dim=-1)
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


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
        if config.checkpoint != "embedded":
            from qharness.sources.models import resolve_checkpoint

            resolve_checkpoint(config.checkpoint)  # a missing directory, config or weights fails here, before any work
        self.graph: torch.nn.Module | None = None  # the prepared exported graph (eager modules for torchao QAT)
        # the distillation teacher, in a list so that it is no submodule: not in state_dict, checkpoints or the optimizer
        self._teacher: list[torch.nn.Module] = []
        self._val_losses: list[float] = []
        self.steps_trained: int | None = None  # optimizer steps behind the weights (set by fit and checkpoint loads)

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
        starts from GPTQ's weights (and scales, when it learns them); not given where a checkpoint's state follows."""
        if self.graph is not None:
            return
        model, _ = self.load_fp()
        gptq_scales = None
        if self.hparams.mode == "qat" and self.recipe.rounds_with_gptq:
            from qharness.recipes.gptq import gptq_round, untie_layers
            from qharness.sources.models import put_weights

            quantizer = self.recipe.make_quantizer(is_qat=False)
            untie_layers(model, quantizer)  # a tied lm_head trains as its own weight (deployment unties it anyway)
            if warm_start is not None:
                weights, gptq_scales = gptq_round(model, quantizer, warm_start)
                put_weights(model, weights)
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
        if gptq_scales is not None and self.recipe.learns_scales:
            from qharness.recipes.learned_scales import start_source_scales

            start_source_scales(model, gptq_scales)
        if self.hparams.activation_checkpointing:
            from qharness.training.layerwise import set_checkpointing

            set_checkpointing(graph, True)
        self.graph = graph
        self._shape = (batch_size, seq_len)

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
            if self.recipe.rounds_with_gptq and self.trainer.state.fn == "fit":
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
        """Deployment runs on CPU. A graph trained on another device (its devices are baked in at export) is
        re-exported on CPU and given the trained state (weights and observers; the rebuild is deterministic)."""
        if self.graph is not None and any(t.device.type != "cpu" for t in self.graph.state_dict().values()):
            self.rebuild_on("cpu")

    def rebuild_on(self, device, state: dict[str, torch.Tensor] | None = None) -> None:
        """Export and prepare the graph again on ``device`` and load ``state`` (default: the current one) into it."""
        state = {k: v.detach().to(device) for k, v in (self.state_dict() if state is None else state).items()}
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
        from qharness.training.layerwise import graph_modules, hf_name

        graphs = graph_modules(self.graph)
        if not graphs:  # eager modules (torchao source-level)
            return learned_qparams(self.graph, prefix="model.")
        out = {}
        for path, graph in graphs:
            for name, qparams in learned_qparams(graph).items():
                out[hf_name(f"{path}.{name}" if path else name)] = qparams
        return {k[len("model.") :]: v for k, v in out.items()}

    def load_into(self, hf_model) -> None:
        """Copy the trained weights into an HF model of the same architecture (``load_weights_into``: tied weights
        trained apart are untied there too)."""
        load_weights_into(self.trained_weights(), hf_model)

    # --- modes ----------------------------------------------------------------------------------
    def fake_quant_on(self, step: int) -> bool:
        return step >= self.hparams.fake_quant_after_n_steps

    def observers_on(self, step: int) -> bool:
        n = self.hparams.freeze_observers_after_n_steps
        return n is None or step < n

    def to_eval(self) -> None:
        if isinstance(self.graph, torch.fx.GraphModule):
            imports.pt2e().move_to_eval(self.graph)
        else:  # eager torchao QAT modules
            self.graph.eval()
        set_static_observers(self.graph, enabled=False)

    def to_train(self) -> None:
        if isinstance(self.graph, torch.fx.GraphModule):
            imports.pt2e().move_to_train(self.graph)
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
        """AdamW with the warm-up + cosine schedule; learned quantization scales (fake quantizers' parameters, e.g.
        ``activation_post_process_3.scale`` or ``...q_proj.weight_fake_quantizer.scale``) get no weight decay."""
        from qharness.recipes.learned_scales import quantization_parameter_names

        scales = quantization_parameter_names(self.graph)
        params = [(n, p) for n, p in self.graph.named_parameters() if p.requires_grad]
        decayed = [n.startswith("model.") and n not in scales for n, _ in params]
        groups = [
            {"params": [p for (_, p), d in zip(params, decayed) if d], "weight_decay": self.hparams.weight_decay},
            {"params": [p for (_, p), d in zip(params, decayed) if not d], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.hparams.lr)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warm, floor = self.hparams.warmup_steps, self.hparams.min_lr_ratio

        def schedule(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            progress = min(1.0, (step - warm) / max(1, total - warm))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule), "interval": "step"},
        }
