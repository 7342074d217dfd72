"""Typed config sections of the stages after training (deploy, parity, calibration, bench, eval, wandb): part of
the run's schema (``qharness.schema.RunConfig``). Their docstrings become ``--help`` text and the config reference.

Each checks its own fields in ``validate()`` when it is built (``UserError`` naming the field); the rules across
sections (``deploy.max_seq_len`` against ``data.seq_len``, ...) are ``RunConfig.validate``'s.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Literal

from qharness.errors import UserError
from qharness.io.names import bad_name_reason


def at_least(section: str, **values) -> None:
    """``values`` are ``name=(value, minimum)``: each must be an int/float >= minimum."""
    for name, (value, minimum) in values.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < minimum
        ):
            raise UserError(
                f"{section}.{name} must be a number >= {minimum} (got {value!r})",
                fix=f"set {section}.{name} >= {minimum}",
            )


def check_source(
    section: str, source, allow_null: bool = True, fix: str = "give an existing file or directory"
) -> None:
    """A section's text ``source`` (null where ``allow_null``: the run's own text): not blank, and a path (``./``,
    ``/``, ``~``) must exist (``fix``: what to give instead)."""
    if not isinstance(source, str):
        return
    if not source.strip():
        raise UserError(
            f"{section}.source is empty",
            fix=f"give a text file or directory{', or leave ' + section + '.source null' if allow_null else ''}",
        )
    if source.startswith((".", "/", "~")) and not Path(source).expanduser().exists():
        raise UserError(f"{section}.source {source} does not exist", fix=fix)


@dataclass
class ExportConfig:
    """Deployment: static-KV-cache export, lowering with the recipe's partitioners, ``.pte``.

    Args:
        enabled: Export, lower and check the ``.pte`` at the end of fit/calibrate.
        max_seq_len: KV-cache length of the ``.pte`` (prompt + generated tokens); above data.seq_len and at most the model's context.
        filename: Name of the ``.pte`` inside the run directory.
    """

    enabled: bool = True
    max_seq_len: int = 256
    filename: str = "model.pte"

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """This section's own rules (``UserError`` naming the field); run when it is built."""
        at_least("deploy", max_seq_len=(self.max_seq_len, 3))
        why = bad_name_reason(self.filename)
        if why or PurePath(self.filename).suffix != ".pte" or self.filename.startswith("."):
            raise UserError(
                f"deploy.filename {self.filename!r} must be a plain file name ending in .pte"
                + (f" ({why})" if why else ""),
                fix="e.g. deploy.filename: model.pte",
            )


@dataclass
class ParityConfig:
    """Parity gate: the ``.pte`` (ExecuTorch runtime) against the converted PyTorch model.

    Args:
        prompts: Held-out prompts (validation blocks) run through prefill + decode in both.
        prompt_len: Tokens per prompt (prefill length).
        decode_steps: Greedy decode steps after the prefill, one token at a time through the KV cache.
        eval_blocks: Validation blocks (at most) scored for perplexity by every model (FP, fake-quant, converted, .pte).
        max_ppl_rel_diff: Fail when |ppl(.pte) - ppl(converted)| / ppl(converted) exceeds this, and exceeds what
            rounding alone moves the converted model's perplexity on the same blocks (parity.noise.ppl_bound: its
            rounding twin's difference plus three standard errors; a deep model with dynamic activation
            quantization can move by more than this).
        min_argmax_agreement: Fail when the .pte and converted model pick the same next token less often than this,
            counted over the positions that are not near ties (see tie_margin).
        tie_margin: Positions where the converted model's top-1/top-2 logit gap is at most this are near ties: a
            logit error of half the margin flips their token, so they are reported (parity.near_ties) but not
            counted in the agreement. Flat logits (random init) are mostly near ties; real drift still flips
            the decided positions.
        max_noise_ratio: Fail when the .pte's mean KL divergence from the converted model exceeds this many times the
            converted model's own rounding noise: its KL from its rounding twin, the same program with every result
            moved one unit in the last place (parity.noise in the summary). Deep models with dynamic activation quantization amplify rounding:
            a kernel computing the same values in another order moves their logits as far as the twin does, and a
            wrong weight, scale or layer moves them much further. Where the twin also agrees less often than
            min_argmax_agreement, the .pte is held to that agreement less three standard errors.
        max_abs_diff: Fail when the largest logit difference exceeds this (null: report only).
        fake_quant_max_ppl_rel_diff: QAT: the .pte against the trained fake-quant model (parity.fake_quant in the
            summary, over one batch of validation blocks): fail when their perplexities differ by more than this.
            Gates every QAT run: the program must be the model QAT trained. Looser than max_ppl_rel_diff: the
            fake-quant model is scored on one batch, with float math of its own.
        fake_quant_min_argmax_agreement: QAT, as above: fail when the .pte and the fake-quant model pick the same
            next token less often than this (positions that are not near ties).
    """

    prompts: int = 4
    prompt_len: int = 32
    decode_steps: int = 8
    eval_blocks: int = 32
    max_ppl_rel_diff: float = 0.02
    min_argmax_agreement: float = 0.9
    tie_margin: float = 0.2
    max_noise_ratio: float = 4.0
    max_abs_diff: float | None = None
    fake_quant_max_ppl_rel_diff: float = 0.05
    fake_quant_min_argmax_agreement: float = 0.8

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """This section's own rules (``UserError`` naming the field); run when it is built."""
        at_least(
            "parity",
            fake_quant_max_ppl_rel_diff=(self.fake_quant_max_ppl_rel_diff, 0),
            prompts=(self.prompts, 1),
            prompt_len=(self.prompt_len, 1),
            decode_steps=(self.decode_steps, 0),
            eval_blocks=(self.eval_blocks, 1),
            max_ppl_rel_diff=(self.max_ppl_rel_diff, 0),
            tie_margin=(self.tie_margin, 0),
            max_noise_ratio=(self.max_noise_ratio, 1),
        )
        for name in ("min_argmax_agreement", "fake_quant_min_argmax_agreement"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UserError(
                    f"parity.{name} must lie in [0, 1] (got {getattr(self, name)})", fix=f"set parity.{name} <= 1"
                )
        if self.max_abs_diff is not None:
            at_least("parity", max_abs_diff=(self.max_abs_diff, 0))


@dataclass
class CalibrationConfig:
    """Calibration data for the deploy graph's observers (PTQ ranges; weight ranges for every recipe).

    Args:
        source: Text source like ``data.source`` (null: the training split of ``data.source``).
        text_field: Column holding the text for json/parquet/csv/hub sources.
        blocks: Blocks of ``data.seq_len`` tokens run through the observers (batch size 1, prefill at position 0).
    """

    source: str | None = None
    text_field: str = "text"
    blocks: int = 32

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """This section's own rules (``UserError`` naming the field); run when it is built."""
        at_least("calibration", blocks=(self.blocks, 1))
        check_source("calibration", self.source)


@dataclass
class BenchConfig:
    """Benchmark of the ``.pte`` and the eager FP model (each in a fresh process) after a passed parity gate.

    Args:
        enabled: Measure load time, prefill/decode tokens/s, peak RSS and size; results go into summary.json.
        prompt_len: Tokens prefilled in one call (prefill tokens/s).
        decode_tokens: Tokens then decoded one at a time (decode tokens/s); prompt_len + decode_tokens <= deploy.max_seq_len.
        reps: Repetitions (each loads the model, prefills, decodes) after one warm-up; the median and min-max are reported.
        eager: Also measure the eager FP model (``qharness sweep`` measures it once, in its FP baseline run).
    """

    enabled: bool = True
    prompt_len: int = 128
    decode_tokens: int = 64
    reps: int = 5
    eager: bool = True

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """This section's own rules (``UserError`` naming the field); run when it is built."""
        at_least("bench", prompt_len=(self.prompt_len, 1), decode_tokens=(self.decode_tokens, 1), reps=(self.reps, 1))


def check_lengths(prompt_len: int, decode_tokens: int, reps: int, max_context_len: int) -> None:
    """A benchmark's lengths against the ``.pte``'s KV cache (``max_context_len`` positions), e.g.
    ``check_lengths(128, 64, 5, 256)`` passes, ``check_lengths(128, 64, 5, 64)`` is a ``UserError``."""
    if prompt_len < 1 or decode_tokens < 1 or reps < 1:
        raise UserError(
            f"bench.prompt_len, bench.decode_tokens and bench.reps must be >= 1 (got {prompt_len}, {decode_tokens}, {reps})",
            fix="e.g. bench.prompt_len: 128, bench.decode_tokens: 64, bench.reps: 5 (qharness bench: --prompt_len ...)",
        )
    if prompt_len + decode_tokens > max_context_len:
        raise UserError(
            f"bench.prompt_len + bench.decode_tokens = {prompt_len + decode_tokens} exceeds the .pte's KV cache ({max_context_len} positions)",
            fix=f"keep bench.prompt_len + bench.decode_tokens <= {max_context_len} (qharness bench: --prompt_len, --decode_tokens), or export with a larger deploy.max_seq_len",
        )


SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes 0 .. 2**64 - 1


def check_generate_args(max_new_tokens: int, temperature: float, top_k: int, seed: int | None = None) -> None:
    """``generate``'s numbers (``qharness generate`` and ``runtime.generate.generate``), before the .pte loads:
    ``UserError`` naming the option."""
    whole = isinstance(seed, int) and not isinstance(seed, bool)
    if seed is not None and not (whole and 0 <= seed < SEED_LIMIT):
        shown = (
            (str(seed) if abs(seed) < SEED_LIMIT**2 else f"a {seed.bit_length()}-bit number") if whole else repr(seed)
        )
        raise UserError(f"--seed must be a whole number from 0 to 2**64 - 1 (got {shown:.60})", fix="e.g. --seed 0")
    for name, value, ok in (
        ("max_new_tokens", max_new_tokens, max_new_tokens >= 1),
        ("temperature", temperature, math.isfinite(temperature) and temperature >= 0),
        ("top_k", top_k, top_k >= 0),
    ):
        if not ok:
            low = 1 if name == "max_new_tokens" else 0
            raise UserError(f"--{name} must be a finite number >= {low} (got {value})", fix=f"e.g. --{name} {low}")


def check_eval_lengths(length: int, seq_len: int, max_seq_len: int) -> None:
    """lm-eval's window (``eval.max_length``, null: ``data.seq_len``) against the graph and the ``.pte``."""
    if length < 2 or length > seq_len or length >= max_seq_len:
        raise UserError(
            f"eval.max_length={length} must lie in [2, data.seq_len={seq_len}] (the fake-quant graph's length) and below deploy.max_seq_len={max_seq_len}",
            fix=f"set eval.max_length <= {min(seq_len, max_seq_len - 1)}, or leave it null",
        )


def check_answer_length(max_new_tokens: int, length: int) -> None:
    """``eval.answers.max_new_tokens`` leaves room for a prompt in lm-eval's window (``length`` tokens)."""
    if max_new_tokens >= length:
        raise UserError(
            f"eval.answers.max_new_tokens={max_new_tokens} leaves no room for a prompt in the {length}-token window "
            "(eval.max_length, null: data.seq_len)",
            fix=f"set eval.answers.max_new_tokens < {length}",
        )


@dataclass
class WandbConfig:
    """Weights & Biases logging through Lightning's WandbLogger, into ``<run dir>/wandb`` beside the CSV logs
    (used when ``trainer.logger`` is left unset; ``trainer.logger: false`` turns every logger off).

    Args:
        enabled: Log the config, train/val curves and the run's final row (metrics, parity, .pte size, tokens/s).
        mode: ``offline`` (no account needed; upload later with ``wandb sync``) or ``online``; null: WANDB_MODE
            if set, else online when you have logged in (``wandb login`` / WANDB_API_KEY), else offline.
        project: wandb project.
        name: Run name (null: ``<recipe>-<mode>``).
        group: Group of runs (``qharness sweep`` sets the sweep's name).
        tags: Tags of the run.
    """

    enabled: bool = True
    mode: Literal["offline", "online"] | None = None
    project: str = "qharness"
    name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """This section's own rules (``UserError`` naming the field); run when it is built."""
        if self.mode not in (None, "offline", "online"):
            raise UserError(
                f"wandb.mode must be offline, online or null (got {self.mode!r})", fix="e.g. wandb.mode: offline"
            )


@dataclass
class AnswersConfig:
    """The answer-quality check of a chat/instruction run: greedy answers of the FP model, the fake-quant model and
    the ``.pte`` to held-out conversations (the last assistant turn is the reference), scored by exact match,
    ROUGE-L and token F1, and against the FP model's own answer, each with a 95% bootstrap interval over conversations.

    Args:
        enabled: Run it when the run's data is chat/instruction or ``eval.answers.source`` is given (with ``eval.enabled``).
        source: Chat or instruction records (a local ``.json``/``.jsonl`` file or directory) to answer; null: the
            held-out (validation) split of the run's own chat data.
        limit: Conversations answered (at most; the first ones of the source).
        max_new_tokens: Tokens each model may generate per answer (prompt + answer fit in ``eval.max_length``).
    """

    enabled: bool = True
    source: str | None = None
    limit: int = 32
    max_new_tokens: int = 48

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """This section's own rules (``UserError`` naming the field); run when it is built."""
        at_least("eval.answers", limit=(self.limit, 1), max_new_tokens=(self.max_new_tokens, 1))
        check_source("eval.answers", self.source)


# The models lm-eval can score, and their column names.
MODEL_KINDS = {"fp": "FP", "fake_quant": "fake-quant", "converted": "converted", "pte": ".pte"}


@dataclass
class EvalConfig:
    """lm-eval evaluation of the FP model, the fake-quant model and the ``.pte`` (one table, saved as eval.json).

    Args:
        enabled: Evaluate at the end of fit/calibrate/export (after the parity gate and the benchmark).
        tasks: lm-eval task names: the offline tasks qharness_ppl (rolling perplexity), qharness_mc (multiple
            choice) and qharness_gen (next-line generation: exact match, which a small model scores ~0; not a
            default), built from the run's validation text or ``eval.source``; or standard lm-eval tasks
            (wikitext, hellaswag, arc_easy, ...) where their data is reachable. The table states each metric's
            chance level where it has one.
        models: Models to evaluate: fp (the FP model), fake_quant (the trained QAT graph; for PTQ the converted
            model stands in), converted (the quantized PyTorch model that was lowered), pte (ExecuTorch runtime).
        limit: Documents per task (null: all; the offline tasks have up to 256). 64 documents put a 4-way
            multiple-choice accuracy's standard error near 0.06.
        num_fewshot: Few-shot examples per prompt (null: each task's default).
        source: Text for the offline tasks, like ``data.source`` (null: the run's held-out validation text).
        text_field: Column holding the text for json/parquet/csv sources.
        max_length: Tokens each model sees at once (rolling-perplexity window, context + generation);
            null: data.seq_len (the fake-quant graph's length). The same for every model.
        include_path: A directory of your own lm-eval task YAMLs (names usable in ``tasks``).
        bootstrap_iters: Bootstrap resamples for the standard errors of non-mean metrics (0: none).
        seed: Seed of the offline documents and of sampled generation.
        chat_template: Render lm-eval's prompts with the chat template (``true``/``false``; ``auto``: when the
            run's data is chat/instruction): the run's ``data.chat_template``, else the tokenizer's.
        system_instruction: With the chat template: a system turn put before every prompt (null: none).
        fewshot_as_multiturn: With the chat template: few-shot examples as earlier user/assistant turns (else one
            user turn holding them all).
        answers: The answer-quality check of chat/instruction runs (greedy answers to held-out conversations).
    """

    enabled: bool = True
    tasks: list[str] = field(default_factory=lambda: ["qharness_ppl", "qharness_mc"])
    models: list[str] = field(default_factory=lambda: ["fp", "fake_quant", "pte"])
    limit: int | None = 64
    num_fewshot: int | None = None
    source: str | None = None
    text_field: str = "text"
    max_length: int | None = None
    include_path: str | None = None
    bootstrap_iters: int = 100
    seed: int = 1234
    chat_template: bool | Literal["auto"] = "auto"
    system_instruction: str | None = None
    fewshot_as_multiturn: bool = True
    answers: AnswersConfig = field(default_factory=AnswersConfig)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """This section's own rules (``UserError`` naming the field); run when it is built."""
        unknown = [m for m in self.models if m not in MODEL_KINDS]
        if unknown or not self.models:
            raise UserError(
                f"eval.models: unknown {unknown or 'empty list'}", fix=f"choose among {', '.join(MODEL_KINDS)}"
            )
        if self.limit is not None:
            at_least("eval", limit=(self.limit, 1))
        if self.num_fewshot is not None:
            at_least("eval", num_fewshot=(self.num_fewshot, 0))
        if self.max_length is not None:
            at_least("eval", max_length=(self.max_length, 2))
        at_least("eval", bootstrap_iters=(self.bootstrap_iters, 0))
        check_source("eval", self.source)
        if not self.tasks:
            raise UserError("eval.tasks is empty", fix="name at least one task, or set eval.enabled: false")
        if self.chat_template not in (True, False, "auto"):
            raise UserError(
                f"eval.chat_template must be true, false or auto (got {self.chat_template!r})",
                fix="e.g. eval.chat_template: auto",
            )
        if self.system_instruction is not None and not self.system_instruction.strip():
            raise UserError("eval.system_instruction is empty", fix="give the instruction's text, or leave it null")
        if isinstance(self.answers, dict):  # built by a parser that does not know nested sections
            self.answers = AnswersConfig(**self.answers)
        self.answers.validate()

    def uses_chat_template(self, chat_data: bool) -> bool:
        """Whether lm-eval renders prompts with the chat template: ``eval.chat_template``, ``auto`` meaning the run's
        data is chat/instruction (``chat_data``)."""
        return chat_data if self.chat_template == "auto" else bool(self.chat_template)


def deep_merge(base: dict, update: dict) -> dict:
    """``update`` over ``base``, mappings merged key by key (copies; neither input changes): config files and
    overrides in order, or a sweep's shared config under a run's own.

    Example: ``deep_merge({"model": {"lr": 1e-4, "mode": "qat"}}, {"model": {"lr": 2e-4}})`` -> lr 2e-4, mode qat
    """
    out = copy.deepcopy(base)
    for k, v in update.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out
