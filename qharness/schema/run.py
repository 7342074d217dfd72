"""``RunConfig``: every section of a run config (what ``qharness fit CONFIG.yaml`` reads) and the rules across them.

Each section checks its own fields when it is built (``validate()``); ``RunConfig.validate`` runs them and then every
rule that needs two sections, each written once here. The CLI runs it before torch loads (``api/precheck.py``) and
again on the parsed config (``api/preflight.py:preflight``); the Python API builds configs from these classes.

Example::

    run = RunConfig.from_yaml("configs/qat_xnnpack.yaml", {"model.lr": 2e-4, "trainer.max_steps": 50})
    run.validate("fit")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from qharness.config import (
    BenchConfig,
    CalibrationConfig,
    EvalConfig,
    ExportConfig,
    ParityConfig,
    WandbConfig,
    check_answer_length,
    check_eval_lengths,
    check_lengths,
    deep_merge,
)
from qharness.errors import UserError
from qharness.io.yaml_reader import read_yaml
from qharness.recipes.registry import Recipe
from qharness.schema.data import DataConfig
from qharness.schema.fields import build, coerce, hints
from qharness.schema.model import ModelConfig, check_layer_units
from qharness.schema.trainer import CheckpointConfig, TrainerConfig
from qharness.sources.chat_demo import check_tuned_split
from qharness.sources.generated import GENERATED

# Sections backed by a Lightning class: names not in the dataclass are that class's own fields (Lightning checks them).
LIGHTNING_SECTIONS = {"trainer", "checkpoint"}
# Fields the CLI sets from others (``QHarnessCLI``'s links): not part of a config file.
LINKED = {("data", "tokenizer"), ("data", "trust_remote_code"), ("checkpoint", "dirpath")}


def _plain(value):
    """Dataclass values as YAML data: tuples as lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


@dataclass
class RunConfig:
    """A run's whole config: one field per section of the YAML.

    Args:
        model: The model, the recipe and QAT/PTQ (``QuantLM``).
        data: The text and its blocks (``TextDataModule``).
        trainer: Lightning's Trainer (the fields qharness sets or checks; every other Trainer field is taken too).
        checkpoint: Lightning's ModelCheckpoint (the fields qharness sets or checks).
        deploy: Deployment to ``.pte``.
        parity: Parity gate of the ``.pte``.
        calibration: Calibration data.
        bench: Benchmark of the ``.pte`` vs the eager FP model.
        eval: lm-eval evaluation of the FP, fake-quant and ``.pte`` models.
        wandb: Weights & Biases logging (offline by default).
        seed_everything: Seed of every random generator (true: a random seed; false: none).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    deploy: ExportConfig = field(default_factory=ExportConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    seed_everything: bool | int | None = 1234

    @classmethod
    def sections(cls) -> dict[str, type]:
        """``{section name: its dataclass}``, in the order of the fields."""
        return {name: tp for name, tp in hints(cls).items() if dataclasses.is_dataclass(tp)}

    @classmethod
    def from_dict(cls, cfg: dict, skip: frozenset[str] | set[str] = frozenset()) -> RunConfig:
        """A run config from a mapping of sections (a YAML's content), each section built and checked from its own
        fields; sections in ``skip`` (which the caller cannot read) keep their defaults. Keys that are not sections
        (a subcommand's options) are left to the caller."""
        kwargs: dict[str, Any] = {}
        for name, section in cls.sections().items():
            if name not in skip and cfg.get(name) is not None:
                kwargs[name] = build(section, name, cfg[name], strict=name not in LIGHTNING_SECTIONS)
        if "seed_everything" not in skip and "seed_everything" in cfg:
            kwargs["seed_everything"] = coerce(cfg["seed_everything"], bool | int | None, "seed_everything")
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path, overrides: dict[str, Any] | None = None) -> RunConfig:
        """The run config of the YAML file ``path`` with ``overrides`` (dotted names: ``{"model.lr": 2e-4}``) on top.
        Each section is checked; call ``validate(subcommand)`` for the rules across sections."""
        cfg = read_yaml(path, "config") or {}
        if not isinstance(cfg, dict):
            raise UserError(f"config file {path} must hold a mapping of sections", fix="e.g. model: {recipe: ...}")
        for key, value in (overrides or {}).items():
            *parents, last = key.split(".")
            update: dict = {last: value}
            for p in reversed(parents):
                update = {p: update}
            cfg = deep_merge(cfg, update)
        return cls.from_dict(cfg)

    def to_dict(self) -> dict:
        """The config as the mapping a config file holds (``qharness fit --config`` takes it as YAML; ``from_dict``
        reads it back), without the fields the CLI links from others (``data.tokenizer``: ``model.checkpoint``)."""
        out = _plain(dataclasses.asdict(self))
        for section, name in LINKED:
            out[section].pop(name, None)
        return out

    def validate(self, subcommand: str | None = None, skip: frozenset[str] | set[str] = frozenset()) -> None:
        """Every section's own rules, then the rules across sections (those touching a section in ``skip``, which
        the caller could not read, are skipped); ``subcommand`` (``fit``, ``calibrate``, ...) adds its own."""
        for name in self.sections():
            if name not in skip:
                getattr(self, name).validate()
        readable = lambda *names: not set(names) & set(skip)  # noqa: E731
        m, d, t = self.model, self.data, self.trainer
        if readable("data", "deploy", "parity"):
            check_across_sections(
                d.seq_len,
                d.batch_size,
                self.deploy.max_seq_len,
                self.parity.eval_blocks,
                self.parity.prompt_len,
                self.parity.decode_steps,
            )
        if readable("data", "deploy", "eval") and (self.eval.enabled or subcommand == "evaluate"):
            check_eval_lengths(self.eval.max_length or d.seq_len, d.seq_len, self.deploy.max_seq_len)
            a = self.eval.answers
            if a.enabled and (d.format in ("chat", "instruction") or a.source is not None):  # auto: once data is read
                check_answer_length(a.max_new_tokens, self.eval.max_length or d.seq_len)
        if readable("deploy", "bench") and self.deploy.enabled and self.bench.enabled:
            check_lengths(self.bench.prompt_len, self.bench.decode_tokens, self.bench.reps, self.deploy.max_seq_len)
        if readable("model", "data"):
            check_tuned_split(m.checkpoint, d.source, d.seq_len, d.val_fraction)
            check_generated(d.source, m.mode, m.distill is not None)
        if readable("model", "trainer"):
            recipe = m.load_recipe()
            if t.strategy == "fsdp_layers":
                check_layer_units(recipe, m.layerwise, m.activation_checkpointing, "trainer.strategy fsdp_layers")
            if not isinstance(t.precision, bool):
                check_precision(t.precision, recipe, m.mode)
            if subcommand == "fit" or (subcommand == "autotune" and m.mode == "qat"):
                check_trains(t)
        if readable("model") and subcommand == "calibrate":
            check_calibrates(m.mode)


def check_generated(source: str, mode: str, distills: bool) -> None:
    """``data.source: generated`` in QAT trains on the FP model's own samples: the signal is the FP model's full
    distribution at each position (distillation), not the one token it happened to sample, so QAT needs
    ``model.distill``. Refused rather than turned on, so the config says what trains (PTQ needs nothing).

    Example::

        check_generated("generated", "qat", distills=False)   # UserError: ... needs model.distill
    """
    if source == GENERATED and mode == "qat" and not distills:
        raise UserError(
            "data.source generated trains QAT on the FP model's own samples, which needs model.distill (the FP "
            "model's distributions are the signal, not its sampled tokens)",
            fix="add model: {distill: {hard_loss: false}} (or --model.distill.hard_loss false), or use model.mode: ptq",
        )


def check_max_seq_len(max_seq_len: int, seq_len: int) -> None:
    """The ``.pte``'s KV cache holds more than one training block."""
    if max_seq_len <= seq_len:
        raise UserError(
            f"deploy.max_seq_len={max_seq_len} must exceed data.seq_len={seq_len}",
            fix=f"set deploy.max_seq_len >= {seq_len + 1}",
        )


def check_across_sections(seq_len, batch_size, max_seq_len, eval_blocks, prompt_len, decode_steps) -> None:
    """The rules across data, deploy and parity, on plain values. Example::

    check_across_sections(128, 8, 128, 32, 32, 8)   # UserError: deploy.max_seq_len=128 must exceed ...
    """
    check_max_seq_len(max_seq_len, seq_len)
    if eval_blocks < batch_size:
        raise UserError(
            f"parity.eval_blocks={eval_blocks} must be >= data.batch_size={batch_size}",
            fix=f"set parity.eval_blocks >= {batch_size}",
        )
    if prompt_len > seq_len or prompt_len + decode_steps >= max_seq_len:
        raise UserError(
            f"parity.prompt_len={prompt_len} (+ decode_steps={decode_steps}) must fit data.seq_len={seq_len} "
            f"and deploy.max_seq_len={max_seq_len}",
            fix="shorten parity.prompt_len/decode_steps, or raise data.seq_len/deploy.max_seq_len",
        )


# trainer.precision values a fake-quant graph trains with: float32 weights, optionally autocast to 16 bits.
# "*-true" half precisions fail inside the fake-quant kernels ("Scale must be Float", dtype asserts).
PRECISIONS_OK = {"32", "32-true", "bf16", "bf16-mixed", "16", "16-mixed"}


def check_precision(precision, recipe: Recipe, mode: str) -> None:
    """Refuse a ``trainer.precision`` the recipe's QAT graph cannot train with (UserError, exit 2).

    Checked on CPU with torch 2.13 / torchao 0.18: PT2E recipes train with ``32-true``, ``bf16-mixed`` and
    ``16-mixed`` (the unfused ``FakeQuantize`` runs under autocast); torchao source-level recipes (8da4w) only
    with ``32-true`` ("Tensor dtype mismatch! Expected: Float, Got: BFloat16" in torchao's fake quantizer).
    """
    p = str(precision) if precision is not None else "32-true"
    if mode != "qat" or p in ("32", "32-true"):
        return
    if p not in PRECISIONS_OK:
        raise UserError(
            f"trainer.precision={p} does not work with fake quantization (weights, scales and observers must stay float32)",
            fix="use 32-true, or bf16-mixed / 16-mixed (autocast) with a PT2E recipe",
        )
    if recipe.kind == "source":
        raise UserError(
            f"trainer.precision={p} does not work with recipe {recipe.name!r} (torchao's fake quantizer needs float32 inputs)",
            fix="use trainer.precision 32-true with this recipe, or a PT2E recipe (xnnpack_int8_dynamic, xnnpack_int4w_dynamic) for mixed precision",
        )


def check_calibrates(mode: str) -> None:
    """``qharness calibrate`` is PTQ: a QAT config is refused before anything loads (and by the Python API's
    ``Trainer.calibrate``, which calls this too)."""
    if mode != "ptq":
        raise UserError(
            f"calibrate needs model.mode: ptq (got {mode!r})", fix="set --model.mode ptq, or use qharness fit for QAT"
        )


def check_trains(trainer: TrainerConfig) -> None:
    """A training run whose trainer settings alone train no step (``limit_train_batches: 0``; ``max_epochs: 0`` is
    ``TrainerConfig``'s own rule): one line before anything loads, instead of a run reported and shipped as trained."""
    value = trainer.limit_train_batches
    if value is not None and not isinstance(value, bool) and value == 0:
        raise UserError(
            f"trainer.limit_train_batches={value} trains no step: the run would be reported and shipped as trained",
            fix="leave trainer.limit_train_batches out or make it positive; for a .pte without training use qharness "
            "calibrate with model.mode: ptq",
        )
