"""Prepare a causal LM you hold for QAT (or PTQ) with a recipe: the module your own loop trains.

``prepare`` applies what a CLI run applies at load (projections as ``nn.Linear``, MoE experts rewritten, the recipe's
rotation, the architecture check), keeps a CPU copy of the FP model (export scores it and deploys into it), then runs
the CLI's ``prepare_for_training`` (pre-dispatch ``torch.export`` + PT2E ``prepare_qat_pt2e``, or torchao's QAT
modules). ``QuantizedModel`` drives the CLI's ``QuantLM`` for its train/eval switches and trained weights.

Example::

    qm = qharness.prepare(model, "xnnpack_8da4w", batch_size=8, seq_len=128, tokenizer=tok)
    out = qm(batch, labels=batch)          # out.loss (shifted cross-entropy), out.logits [8, 128, vocab]
    out.loss.backward()
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from qharness.api.arguments import (
    EXPORT_LOCK,
    PREPARED,
    ROTATED,
    check_flag,
    check_preparable,
    check_tokens,
    unwrap_compiled,
    vocab_size,
)
from qharness.api.recipes import Recipe, load_recipe
from qharness.errors import UserError

__all__ = ["QuantizedModel", "calibrate", "prepare"]

MODES = ("qat", "ptq")


class QuantizedModel(torch.nn.Module):
    """A causal LM prepared with a recipe: ``forward(input_ids, labels=None)`` gives ``.loss`` and ``.logits`` as a
    ``transformers`` model does, at the static shape ``[batch_size, seq_len]`` it was prepared for.

    Attributes: ``recipe`` (the ``Recipe``), ``mode`` (``qat``/``ptq``), ``tokenizer``, ``fp_model`` (the FP model as
    prepared, CPU, never trained: export's FP reference), ``batch_size``, ``seq_len``, ``calibration`` (PTQ: the blocks
    ``calibrate`` gave). Its ``state_dict()`` holds the trained graph (``graph.*``, the keys of a CLI checkpoint's
    ``state_dict``) and ``trained_batches``; it loads back into a model prepared alike (``load_state_dict``).

    Example::

        qm.train()                                  # fake-quant graph in training mode (observers on)
        loss = qm(x, labels=x).loss                 # x: LongTensor [batch_size, seq_len]
        torch.save(qm.state_dict(), "qat.pt")       # resume: qm2 = prepare(...); qm2.load_state_dict(torch.load("qat.pt"))
    """

    # transformers.Trainer reads this: a forward taking **kwargs would otherwise be assumed to normalize its loss by
    # the batch's token count (``num_items_in_batch``), and the Trainer would skip dividing it by the gradient
    # accumulation steps (gradients gradient_accumulation_steps times too large). The loss here is a per-batch mean.
    accepts_loss_kwargs = False

    def __init__(self, graph, fp_model, recipe: Recipe, mode: str, tokenizer, batch_size: int, seq_len: int):
        super().__init__()
        from qharness.training.module import QuantLM

        lm = QuantLM(
            recipe=recipe.source or recipe.name, mode=mode
        )  # the CLI's module, for its mode switches and trained weights
        lm.graph = graph
        self._lm = [lm]  # in a list: not a submodule (its graph is this module's own)
        self._fp = [fp_model]  # not a submodule: no optimizer sees the FP weights, .to() leaves them on CPU
        self.graph = graph
        self.recipe, self.mode, self.tokenizer = recipe, mode, tokenizer
        self.batch_size, self.seq_len = batch_size, seq_len
        self.calibration: torch.Tensor | None = None
        self.register_buffer("trained_batches", torch.zeros((), dtype=torch.long))
        # what the state was prepared with, in the state dict (a tensor: safetensors files keep it): a state of
        # another recipe or mode whose keys and shapes happen to match (8da4w and 8da3w) is refused, not loaded
        self.register_buffer("qharness_recipe", torch.tensor(list(self._record().encode()), dtype=torch.uint8))
        self.train(graph is not None)  # QAT starts in training mode, as any nn.Module

    @property
    def fp_model(self) -> torch.nn.Module:
        return self._fp[0]

    def _record(self) -> str:
        return f"{self.recipe.name} ({self.mode})"

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        """The recipe record checked first (any loader: ``load_state_dict``, Lightning's); a state without one (saved
        before it was recorded) loads as before."""
        key = prefix + "qharness_recipe"
        saved = state_dict.get(key)
        if isinstance(saved, torch.Tensor):
            record = bytes(saved.to(torch.uint8).tolist()).decode(errors="replace")
            if record != self._record():
                raise UserError(
                    f"the state was saved from a model prepared with {record}; this QuantizedModel is {self._record()}",
                    fix=f"prepare the model with the recipe and mode the state was saved from ({record}), or start "
                    "from the FP model",
                )
        state_dict[key] = self.qharness_recipe
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **ignored):
        """``CausalLMOutput(loss, logits)``: ``loss`` is the shifted cross-entropy when ``labels`` are given (``labels =
        input_ids`` as in transformers; ``-100`` ignored); other keyword arguments (``attention_mask``) are ignored."""
        from transformers.modeling_outputs import CausalLMOutput

        shape = (self.batch_size, self.seq_len)
        if not isinstance(input_ids, torch.Tensor):
            raise UserError(
                f"input_ids is a {type(input_ids).__name__}",
                fix=f"pass a LongTensor of token ids of shape {list(shape)}",
            )
        if tuple(input_ids.shape) != shape:
            got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise UserError(
                f"a batch of shape {got}: this model was prepared for the static shape {list(shape)} "
                "(batch_size, seq_len)",
                fix=f"feed batches of exactly {list(shape)} tokens (drop the last partial batch: DataLoader(..., "
                "drop_last=True)), or prepare again with that batch_size and seq_len",
            )
        check_tokens(input_ids, vocab_size(self.fp_model), "input_ids")
        if self.graph is None:  # PTQ: the FP model (the observers run at export, on the deploy graph)
            logits = self.fp_model(input_ids=input_ids.cpu(), use_cache=False).logits
        else:
            logits = self._lm[0].forward_checked(input_ids)
            if self.training and torch.is_grad_enabled():
                self.trained_batches += 1
        loss = None
        if labels is not None:
            if tuple(labels.shape) != shape:
                raise UserError(f"labels of shape {tuple(labels.shape)}", fix=f"pass labels of {list(shape)}")
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        return CausalLMOutput(loss=loss, logits=logits)

    def train(self, mode: bool = True) -> QuantizedModel:
        """Training or evaluation mode: a PT2E graph is switched with ``move_exported_model_to_train/eval`` and its
        static observers frozen in evaluation, as the CLI's validation does (``QuantLM.to_train/to_eval``)."""
        self.training = mode
        if self.graph is not None:
            lm = self._lm[0]
            (lm.to_train if mode else lm.to_eval)()
        return self

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; a state of another model, recipe or shape is one ``UserError`` line.

        A state without module versions (``_metadata``: safetensors files, e.g. ``transformers.Trainer``'s
        checkpoints, and dict copies keep none) is loaded with this model's own: torchao's observers treat a
        version-less state as version 1 and reset their ``eps`` buffers (XNNPACK's 2**-12 becomes float32's eps)."""
        if getattr(state_dict, "_metadata", None) is None:
            metadata = super().state_dict()._metadata
            state_dict = collections.OrderedDict(state_dict)
            state_dict._metadata = metadata
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        except RuntimeError as e:
            first = next((ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()), str(e).splitlines()[0])
            raise UserError(
                f"the state does not fit this QuantizedModel: {first}",
                fix="prepare the same model with the same recipe, mode, batch_size and seq_len it was saved from",
            ) from e

    # --- what export needs (the CLI's QuantLM methods on this graph) --------------------------
    def trained_weights(self) -> dict[str, torch.Tensor]:
        """The trained FP weights keyed by the HF model's parameter names (QAT)."""
        return self._lm[0].trained_weights()

    def learned_qparams(self) -> dict | None:
        """QAT with learned scales: ``{HF weight name: (scale, zero_point)}`` as trained; else None."""
        return self._lm[0].learned_qparams()

    def deploy_qparams(self) -> dict | None:
        """QAT: ``{HF weight name: (scale, zero_point)}`` the trained graph quantizes its weights with (learned, or the
        min-max scales its PT2E weight fake-quants hold), which export carries into the ``.pte``; else None."""
        return self._lm[0].deploy_qparams()

    def cpu_fake_quant(self) -> torch.nn.Module:
        """The trained fake-quant graph on CPU in evaluation mode: this graph, or (trained on another device, whose
        devices the export baked in) ``rebuilt_on_cpu()``."""
        if any(t.device.type != "cpu" for t in self.graph.state_dict().values()):
            return self.rebuilt_on_cpu()
        self._lm[0].to_eval()
        return self.graph

    def rebuilt_on_cpu(self) -> torch.nn.Module:
        """The same preparation of the FP copy, on CPU, with this graph's trained state (weights and observers; the
        preparation is deterministic, as the CLI's ``QuantLM.rebuild_on``), in evaluation mode."""
        from qharness.training.module import QuantLM
        from qharness.training.prepare import prepare_for_training
        from qharness.training.weights import state_on

        graph = prepare_for_training(
            copy.deepcopy(self.fp_model), self.recipe, self.batch_size, self.seq_len, is_qat=True
        )
        graph.load_state_dict(state_on(self.graph.state_dict(), "cpu"))
        lm = QuantLM(recipe=self.recipe.source or self.recipe.name, mode=self.mode)
        lm.graph = graph
        lm.to_eval()
        return graph


def check_causal_lm(model, what: str = "model") -> None:
    """``model`` is a float32 transformers causal LM (``AutoModelForCausalLM``), else one ``UserError`` line."""
    if isinstance(model, QuantizedModel):
        raise UserError(
            f"{what} is a QuantizedModel, already prepared with {model._record()}",
            fix="train or export it as it is; prepare takes the FP transformers model (its .fp_model is a copy of it)",
        )
    config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or not hasattr(config, "get_text_config"):
        raise UserError(
            f"{what} is a {type(model).__name__}, not a transformers causal LM",
            fix="pass a model from transformers' AutoModelForCausalLM (from_pretrained or from_config)",
        )
    if getattr(config, "is_encoder_decoder", False):
        raise UserError(f"{what} is an encoder-decoder", fix="pass a decoder-only causal LM")
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point()})
    if dtypes != ["torch.float32"]:
        raise UserError(
            f"{what} has {', '.join(dtypes) or 'no'} floating-point parameters; qharness trains and quantizes float32",
            fix="load it with dtype=torch.float32 (or call model.float())",
        )


def context_of(model) -> int | None:
    """The model's context (``max_position_embeddings`` of its text config), None when it has none."""
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def check_shape(batch_size, seq_len, context: int | None) -> None:
    """``batch_size`` >= 1 and ``2 <= seq_len <= context``, as whole numbers."""
    for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UserError(f"{name} must be a whole number >= {low} (got {value!r})", fix=f"e.g. {name}=8")
    if context is not None and seq_len > context:
        raise UserError(f"seq_len={seq_len} exceeds the model's context ({context})", fix=f"use seq_len <= {context}")


def model_label(model) -> str:
    """What the summary records as the model: its ``name_or_path`` (a directory or hub id), else its class."""
    return getattr(model.config, "_name_or_path", "") or type(model).__name__


def prepare(
    model: torch.nn.Module,
    recipe: str | Path | Recipe,
    *,
    mode: str = "qat",
    batch_size: int,
    seq_len: int,
    tokenizer=None,
    check_architecture: bool = True,
) -> QuantizedModel:
    """Prepare ``model`` (a float32 transformers causal LM) for QAT or PTQ with ``recipe`` (name, YAML path or
    ``Recipe``) at the static batch shape ``[batch_size, seq_len]``.

    ``model`` is changed in place as a CLI run changes what it loads (projections as ``nn.Linear``, MoE experts, the
    recipe's rotation: the same function) and then becomes the trained graph's weights; a CPU copy of it taken before
    is kept as ``fp_model`` (one more FP copy of the weights in memory: export scores it and deploys the trained
    weights into it). The architecture is checked first, as ``qharness fit`` does (a one-layer copy deployed with the
    recipe, cached). ``mode="ptq"`` exports nothing now: ``calibrate`` then ``export`` (the CLI's ``calibrate``).
    ``tokenizer`` (an HF tokenizer) is kept for ``export``. ``check_architecture=False`` skips the one-layer deploy
    check (``export`` of an FP model, which deploys right after, does). QAT recipes with ``rounding: gptq`` start from the FP
    weights here (the CLI's ``fit`` starts from GPTQ's).

    Example::

        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained("path/to/model", dtype=torch.float32)
        qm = qharness.prepare(model, "xnnpack_8da4w", batch_size=8, seq_len=128, tokenizer=tok)
    """
    model = unwrap_compiled(model)
    recipe = load_recipe(recipe)
    if not isinstance(mode, str) or mode not in MODES:
        raise UserError(f"mode must be one of {', '.join(MODES)} (got {mode!r})", fix='mode="qat" or mode="ptq"')
    recipe.check_mode(mode)  # the model section's rule for a recipe and mode (schema.ModelConfig.validate)
    check_flag(check_architecture, "check_architecture")
    check_causal_lm(model)
    check_preparable(model, mode, recipe)
    check_shape(batch_size, seq_len, context_of(model))
    if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
        raise UserError(
            f"tokenizer is a {type(tokenizer).__name__}", fix="pass the model's transformers tokenizer (AutoTokenizer)"
        )
    with EXPORT_LOCK:
        if check_architecture:
            check_deploys(model, recipe, seq_len)
        from qharness.sources.normalize import normalize_model

        normalize_model(model)
        if recipe.rotation is not None:
            from qharness.recipes.rotation import rotate

            rotate(model, recipe.rotation)
            setattr(model, ROTATED, recipe.name)  # copies keep it: a second rotation is refused
        if mode == "qat" and recipe.rounds_with_gptq:
            from qharness.recipes.gptq import untie_layers

            untie_layers(model, recipe.make_quantizer(is_qat=False))
        model.eval()
        if mode == "ptq":  # the FP model itself: nothing trains it
            return QuantizedModel(None, model.cpu(), recipe, mode, tokenizer, batch_size, seq_len)
        fp_model = copy.deepcopy(model).to("cpu").eval()
        from qharness.training.prepare import prepare_for_training

        graph = prepare_for_training(model, recipe, batch_size, seq_len, is_qat=True)
        setattr(model, PREPARED, f"{recipe.name} (qat)")  # its tensors are the graph's now: no second prepare
        return QuantizedModel(graph, fp_model, recipe, mode, tokenizer, batch_size, seq_len)


def check_deploys(model, recipe: Recipe, seq_len: int) -> None:
    """The CLI's architecture check before training (``deploy/architectures.py``): a one-layer copy of ``model``'s
    config exported, quantized and lowered with ``recipe`` (cached per config and recipe)."""
    from qharness.deploy.architectures import check_architecture

    context = context_of(model)
    max_seq_len = max(seq_len + 1, 64) if context is None else min(max(seq_len + 1, 64), context)
    check_architecture(model_label(model), recipe=recipe, max_seq_len=max_seq_len, config=model.config)


def calibrate(prepared: QuantizedModel, batches: Iterable[torch.Tensor]) -> QuantizedModel:
    """PTQ: the calibration blocks of a ``mode="ptq"`` model, from ``batches`` (each a ``[rows, seq_len]`` token tensor,
    e.g. the batches of your DataLoader). ``export`` runs the recipe's observers over them in the static-KV-cache
    deploy graph, one block at a time, as ``qharness calibrate`` does (``training/calibration.py``), so the program
    is the CLI's. Returns ``prepared``.

    Example::

        qm = qharness.calibrate(qharness.prepare(model, "xnnpack_8da4w", mode="ptq", batch_size=8, seq_len=128), batches)
        qharness.export(qm, "out/", validation=val_text)
    """
    if not isinstance(prepared, QuantizedModel) or prepared.mode != "ptq":
        got = prepared.mode if isinstance(prepared, QuantizedModel) else type(prepared).__name__
        raise UserError(
            f"calibrate takes a model prepared with mode='ptq' (got {got!r})",
            fix="qharness.prepare(model, recipe, mode='ptq', ...); a QAT model is trained, then exported",
        )
    if isinstance(batches, torch.Tensor) and batches.dim() == 2:
        batches = [batches]  # one batch given as it is
    if isinstance(batches, (str, bytes, dict, torch.Tensor)) or not isinstance(batches, Iterable):
        raise UserError(
            f"calibrate's batches is a {type(batches).__name__}",
            fix=f"pass an iterable of [rows, {prepared.seq_len}] token tensors (a list, or your DataLoader)",
        )
    blocks = []
    vocab = vocab_size(prepared.fp_model)
    for i, batch in enumerate(batches):
        if (
            not isinstance(batch, torch.Tensor)
            or batch.dim() != 2
            or batch.shape[1] != prepared.seq_len
            or batch.dtype not in (torch.int32, torch.int64)
        ):
            got = f"{batch.dtype} {tuple(batch.shape)}" if isinstance(batch, torch.Tensor) else type(batch).__name__
            raise UserError(
                f"calibration batch {i} is {got}",
                fix=f"give integer token tensors of shape [rows, {prepared.seq_len}] (the prepared seq_len)",
            )
        check_tokens(batch, vocab, f"calibration batch {i}")
        blocks.append(batch.detach().to("cpu", torch.long))
    if not blocks:
        raise UserError("calibrate got no batches", fix="give at least one [rows, seq_len] token tensor")
    prepared.calibration = torch.cat(blocks)
    return prepared
