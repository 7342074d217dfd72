"""The tail of every run: deploy (export -> quantize -> lower -> ``.pte``), parity gate, summary.

Stages take plain inputs (``Trained``, ``HeldOut``: models, recipe, tensors, tokenizer); Lightning's side
(``qharness.api.lightning_cli``) builds them from the LightningModule and the DataModule.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qharness.checks.parity import (
    compare_blocks,
    compare_decoding,
    fold_constants,
    gate,
    learned_scales_carried,
    score_batched,
    score_deployed,
)
from qharness.checks.stats import with_intervals
from qharness.config import BenchConfig, EvalConfig, ExportConfig, ParityConfig
from qharness.deploy.fastpath.twin import all_logits_twin
from qharness.errors import ParityError, UserError
from qharness.io.atomic import atomic_dir, write_bytes_atomic
from qharness.progress import stage
from qharness.run.summary import LayerPlan, Parity, PteInfo, RunSummary, Score, Timings, typed
from qharness.run.table import format_table
from qharness.schema.run import check_max_seq_len
from qharness.upstream import process

log = logging.getLogger(__name__)


def check_export_config(cfg: ExportConfig, seq_len: int, context: int | None) -> None:
    check_max_seq_len(cfg.max_seq_len, seq_len)
    if context is not None and cfg.max_seq_len > context:
        raise UserError(
            f"deploy.max_seq_len={cfg.max_seq_len} exceeds the model's context ({context})",
            fix=f"set deploy.max_seq_len <= {context}",
        )


def validation_blocks_id(x: torch.Tensor, y: torch.Tensor) -> str:
    """A digest of the scored validation blocks: runs with the same one were scored on the very same tokens
    (same data, seq_len and eval_blocks), so their per-block losses pair up (``qharness report``)."""
    digest = hashlib.sha256()
    for t in (x, y):
        digest.update(str(tuple(t.shape)).encode())
        digest.update(t.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def eos_ids(model, tokenizer, end_of_turn: list[int] = ()) -> list[int]:
    """EOS ids of the tokenizer and of the model's generation config (an id or a list), and ``end_of_turn``: a chat
    template's end-of-turn tokens (``<|im_end|>``, ``<|eot_id|>``) when the run trained on chat/instruction data, so
    the runner stops at the end of an answer."""
    config_eos = getattr(model.generation_config, "eos_token_id", None)
    ids = config_eos if isinstance(config_eos, list) else [config_eos]
    return sorted({i for i in [*ids, tokenizer.eos_token_id, *end_of_turn] if i is not None})


@dataclass
class Trained:
    """What training hands to deployment, as plain objects (no Lightning): build it with ``QuantLM.trained()``.

    Args:
        fp_model: The FP model as loaded (HF causal LM, eval mode, CPU).
        tokenizer: Its tokenizer.
        recipe: The backend recipe.
        mode: ``qat`` or ``ptq``.
        checkpoint: ``model.checkpoint`` as configured (recorded in the summary).
        model_dir: The directory ``fp_model`` was loaded from (the eager benchmark loads it in a fresh process).
        fake_quant: QAT: the trained fake-quant graph, eval mode, CPU: ``fake_quant(x[B, T]) -> logits``.
        load_trained: QAT: ``load_trained(hf_model)`` puts the trained weights into an FP model of the same shape.
        weight_qparams: QAT with learned scales: ``{HF weight name: (scale, zero_point)}`` as trained; the deployed
            program quantizes each weight with these (else with min-max of the trained weights).
        distill: QAT with distillation: its settings (``kl_weight``, ``temperature``, ``hard_loss``; recorded).
        lora: LoRA-QAT: its settings, adapted layers and trained parameter count (recorded; the weights that
            ``load_trained`` puts in are already merged).
    """

    fp_model: torch.nn.Module
    tokenizer: object
    recipe: object
    mode: str
    checkpoint: str
    model_dir: str
    fake_quant: torch.nn.Module | None = None
    load_trained: Callable[[torch.nn.Module], None] | None = None
    weight_qparams: dict | None = None
    distill: dict | None = None
    lora: dict | None = None


@dataclass
class HeldOut:
    """The data deployment checks with, as tensors: validation blocks ``x``/``y`` ``[n, seq_len]`` (scored by every
    model; the parity prompts are their prefixes), calibration blocks ``[m, seq_len]``, and the text lm-eval's offline
    tasks are built from (``texts()``, called only when lm-eval runs). Build it with ``held_out(datamodule, ...)``."""

    x: torch.Tensor
    y: torch.Tensor
    batch_size: int
    calibration: torch.Tensor
    texts: Callable[[], list[str]]
    end_of_turn: list[int] = dataclasses.field(default_factory=list)  # chat data: the template's end-of-turn ids

    @property
    def seq_len(self) -> int:
        return self.x.shape[1]


def with_gptq(trained: Trained, calibration: torch.Tensor) -> Trained:
    """PTQ with a ``rounding: gptq`` recipe: ``trained`` whose weights are GPTQ's rounding of the FP model on the
    ``calibration`` blocks and whose ``weight_qparams`` are GPTQ's scales, so the ``.pte`` holds exactly GPTQ's weights
    (the parity gate checks that every scale reached it). Anything else: ``trained`` as it is."""
    if trained.mode != "ptq" or not trained.recipe.rounds_with_gptq:
        return trained
    from qharness.recipes.gptq import gptq_round
    from qharness.sources.models import put_weights

    weights, qparams = gptq_round(trained.fp_model, trained.recipe.make_quantizer(is_qat=False), calibration)
    return dataclasses.replace(trained, load_trained=lambda model: put_weights(model, weights), weight_qparams=qparams)


def deploy_graph(
    trained: Trained, calibration: torch.Tensor, max_seq_len: int, copy_fp: bool = True
) -> torch.fx.GraphModule:
    """The converted (quantized) static-KV-cache graph of the trained weights: the FP model (a copy unless
    ``copy_fp`` is False), the trained weights loaded into it (QAT), exported and quantized by the recipe with
    ``calibration`` blocks through its observers. What the ``.pte`` is lowered from, and the parity reference."""
    from qharness.deploy.lower import quantize_for_deploy
    from qharness.training.calibration import calibrate

    model = copy.deepcopy(trained.fp_model) if copy_fp else trained.fp_model
    if trained.load_trained is not None:
        trained.load_trained(model)
    return quantize_for_deploy(
        model, trained.recipe, max_seq_len, lambda graph: calibrate(graph, calibration), trained.weight_qparams
    )


def deploy_and_check(
    trained: Trained,
    data: HeldOut,
    run_dir: Path,
    export_cfg: ExportConfig,
    parity_cfg: ParityConfig,
    bench_cfg: BenchConfig = BenchConfig(enabled=False),
    eval_cfg: EvalConfig = EvalConfig(enabled=False),
) -> RunSummary:
    """Write the ``.pte``, the tokenizer and ``summary.json`` into ``run_dir``; raise ParityError on failure.

    The ``.pte`` is written as ``<name>.pending.pte`` and takes its final name only once the parity gate passed
    (a failed one is kept as ``<name>.FAILED_PARITY.pte``). A ``.pte`` that passed is benchmarked (``bench_cfg``)
    against the eager FP model, then the FP, fake-quant and ``.pte`` models are evaluated with lm-eval
    (``eval_cfg``; ``eval.json``, summary ``eval``). Stages: ``score_trained`` -> ``export_and_quantize`` ->
    ``lower_and_write`` -> ``check_parity`` -> ``write_summary`` -> ``bench_run`` -> ``evaluate_run``.

    Example::

        summary = deploy_and_check(trained(module), held_out(dm, parity_cfg, calib_cfg), Path("runs/x"),
                                   ExportConfig(), ParityConfig())
        summary.pte.size_bytes, summary.parity.passed
    """
    from qharness.deploy.lower import runner_metadata

    process.map_large_allocations_separately()  # freed weight-sized temporaries leave RSS (see qharness/upstream/process.py)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    text_config = trained.fp_model.config.get_text_config()
    check_export_config(export_cfg, data.seq_len, getattr(text_config, "max_position_embeddings", None))
    tokenizer = trained.tokenizer
    metadata = runner_metadata(
        export_cfg.max_seq_len,
        text_config.vocab_size,
        tokenizer.bos_token_id,
        eos_ids(trained.fp_model, tokenizer, data.end_of_turn),
    )
    timings = Timings()
    t = time.perf_counter()
    trained = with_gptq(trained, data.calibration)
    if trained.mode == "ptq" and trained.weight_qparams is not None:
        timings.gptq_s = time.perf_counter() - t
    scores = score_trained(trained, data)
    keep_fp = eval_cfg.enabled  # lm-eval scores the FP model after the .pte is written
    fp_model = trained.fp_model
    deployed = export_and_quantize(trained, data, export_cfg, keep_fp, timings)
    if not keep_fp:  # the deployed graph holds the weights it uses; the FP copies of quantized ones go
        fp_model = trained.fp_model = None
    lowered = lower_and_write(deployed, trained, metadata, export_cfg, run_dir, timings)
    checked = check_parity(trained, lowered, data, parity_cfg, scores, timings)
    summary = write_summary(trained, data, lowered, checked, run_dir, export_cfg, timings)
    if summary.parity.reasons:
        raise ParityError(f"parity gate failed for {summary.pte.path}: " + "; ".join(summary.parity.reasons))
    if bench_cfg.enabled and trained.recipe.runs_here:
        bench_run(summary, trained, bench_cfg, run_dir)
    if eval_cfg.enabled:
        pte_path = Path(summary.pte.path) if trained.recipe.runs_here else None
        summary.eval = evaluate_run(trained, data, fp_model, checked.reference, pte_path, run_dir, eval_cfg)
        summary.write(run_dir / "summary.json")
    return summary


@dataclass
class Lowered:
    """What lowering hands the checks: the converted graph, the program's bytes and the file they wait in for the
    gate (``<name>.pending.pte``)."""

    deployed: torch.fx.GraphModule
    pte_bytes: bytes
    pending: Path


@dataclass
class Checked:
    """What the checks hand the summary: every model's scores, the gate's figures and the reference (the converted
    graph with its constants folded, which lm-eval scores later)."""

    metrics: dict[str, Score]
    parity: Parity
    reference: torch.fx.GraphModule


def score_trained(trained: Trained, data: HeldOut) -> dict[str, dict]:
    """The FP model's (and QAT: the trained fake-quant graph's) scores on the validation blocks; a NaN/inf loss stops
    the run before anything is exported."""
    vx, vy = data.x, data.y
    fp_model = trained.fp_model
    scores = {
        "fp": score_batched(
            lambda x: fp_model(input_ids=x).logits, vx, vy, data.batch_size, desc="scoring the FP model"
        )
    }
    if not math.isfinite(scores["fp"]["loss"]):
        raise UserError(
            f"the FP model {trained.checkpoint} gives a {scores['fp']['loss']} validation loss (stage: scoring the FP "
            "model); nothing was exported",
            fix="use a model whose weights are finite and small enough not to overflow (check model.checkpoint)",
        )
    if trained.fake_quant is not None:  # QAT: the trained fake-quant graph
        scores["fake_quant"] = score_batched(
            trained.fake_quant, vx, vy, data.batch_size, desc="scoring the fake-quant model"
        )
        if not math.isfinite(scores["fake_quant"]["loss"]):
            raise FloatingPointError(
                f"the trained fake-quant model gives a {scores['fake_quant']['loss']} validation loss (stage: scoring "
                "the fake-quant model); nothing was exported. fix: lower model.lr or check the data, and train again"
            )
    return scores


def export_and_quantize(
    trained: Trained, data: HeldOut, export_cfg: ExportConfig, keep_fp: bool, timings: Timings
) -> torch.fx.GraphModule:
    """The converted static-KV-cache graph (``deploy_graph``), timed; the FP model is copied only when lm-eval
    scores it later (``keep_fp``) and the trained weights or torchao would change it in place."""
    recipe = trained.recipe
    t = time.perf_counter()
    with stage(f"static-KV-cache export + quantization ({recipe.name})"):
        deployed = deploy_graph(
            trained,
            data.calibration,
            export_cfg.max_seq_len,
            copy_fp=keep_fp and (trained.load_trained is not None or recipe.kind == "source"),
        )
    timings.export_quantize_s = time.perf_counter() - t
    return deployed


def lower_and_write(
    deployed: torch.fx.GraphModule,
    trained: Trained,
    metadata: dict,
    export_cfg: ExportConfig,
    run_dir: Path,
    timings: Timings,
) -> Lowered:
    """Lower ``deployed`` to ExecuTorch with the runner's ``metadata``, write it as ``<name>.pending.pte`` (not the
    name anyone ships) and the tokenizer beside it."""
    from qharness.deploy.lower import lower_to_pte

    recipe, tokenizer = trained.recipe, trained.tokenizer
    t = time.perf_counter()
    with stage(f"lowering to ExecuTorch ({recipe.name}, {recipe.backend})"):
        pte_bytes = lower_to_pte(deployed, recipe, export_cfg.max_seq_len, metadata)
    timings.lower_s = time.perf_counter() - t
    final = run_dir / export_cfg.filename
    pending = write_bytes_atomic(final.with_name(final.stem + ".pending.pte"), pte_bytes)
    with atomic_dir(run_dir / "tokenizer") as tokenizer_dir:
        tokenizer.save_pretrained(tokenizer_dir)
    return Lowered(deployed, pte_bytes, pending)


def check_parity(
    trained: Trained, lowered: Lowered, data: HeldOut, cfg: ParityConfig, scores: dict[str, dict], timings: Timings
) -> Checked:
    """Score the converted model and (where the backend runs here) the ``.pte`` on the validation blocks, and gate
    the ``.pte``'s decoding against the converted model's (``gate_pte``)."""
    t = time.perf_counter()
    reference = fold_constants(lowered.deployed)  # the same outputs, the weight math done once
    scorer = all_logits_twin(reference)  # the same weights and ops (and KV cache), every position's logits
    scores = dict(scores)
    scores["converted"] = score_deployed(
        lambda tokens, start: scorer(tokens, torch.tensor([start], dtype=torch.long)),
        data.x,
        data.y,
        desc="scoring the converted model",
    )
    reasons = non_finite_scores(scores, "converted")  # NaN passes no gate, run here or not
    if trained.recipe.runs_here:
        figures = gate_pte(trained, lowered, reference, data, cfg, scores, reasons)
    else:
        figures = {
            "passed": False if reasons else None,
            "skipped": f"the {trained.recipe.backend} backend cannot run on this machine (recipe runs_here: false)",
            "reasons": reasons,
        }
        log.warning("parity gate skipped: %s", figures["skipped"])
    timings.parity_s = time.perf_counter() - t
    metrics = with_intervals(scores)  # every model scored on the same blocks: paired against FP
    return Checked(typed(dict[str, Score], metrics, "metrics"), typed(Parity, figures, "parity"), reference)


def gate_pte(
    trained: Trained,
    lowered: Lowered,
    reference: torch.fx.GraphModule,
    data: HeldOut,
    cfg: ParityConfig,
    scores: dict[str, dict],
    reasons: list[str],
) -> dict:
    """The parity gate of a ``.pte`` that runs here: its scores (added to ``scores``), its decoding against the
    converted model's, (QAT) against the trained fake-quant graph, and whether learned scales reached it exactly."""
    from qharness.runtime.pte import PteModel

    def ref(tokens, start):  # called as the .pte is: last-token logits on the fast path (decode parity)
        return reference(tokens, torch.tensor([start], dtype=torch.long))

    pte = PteModel(lowered.pending)
    scores["pte"] = score_deployed(pte, data.x, data.y, desc="scoring the .pte")
    reasons = reasons + non_finite_scores(scores, "pte")
    prompts = data.x[: cfg.prompts, : cfg.prompt_len]
    figures = compare_decoding(
        pte, ref, prompts, cfg.decode_steps, desc="parity: .pte vs converted decoding", tie_margin=cfg.tie_margin
    )
    figures["ppl_rel_diff"] = abs(scores["pte"]["ppl"] - scores["converted"]["ppl"]) / scores["converted"]["ppl"]
    reasons += gate(figures, cfg)
    if trained.fake_quant is not None:
        figures["fake_quant"] = against_fake_quant(trained, pte, data, scores, cfg)
        if figures["fake_quant"]["gated"]:
            reasons += [f".pte vs trained fake-quant: {r}" for r in figures["fake_quant"]["reasons"]]
    if trained.weight_qparams is not None:
        figures["learned_scales"] = carried = learned_scales_carried(lowered.deployed, trained.weight_qparams)
        if carried["exact"] != carried["weights"]:
            reasons.append(
                f"only {carried['exact']} of {carried['weights']} learned weight scales reached the program exactly"
            )
    figures["passed"] = not reasons
    figures["reasons"] = reasons
    return figures


def write_summary(
    trained: Trained,
    data: HeldOut,
    lowered: Lowered,
    checked: Checked,
    run_dir: Path,
    export_cfg: ExportConfig,
    timings: Timings,
) -> RunSummary:
    """Give the ``.pte`` its final name (``<name>.FAILED_PARITY.pte`` when the gate failed: kept for inspection,
    under a name no one ships by mistake), write ``summary.json`` (keeping earlier evaluations) and print the table."""
    from qharness.deploy.deployed import export_path, fallback_reason, graph_coverage, kv_cache_dtype, quantized_layers
    from qharness.deploy.lower import layer_counts

    recipe, deployed = trained.recipe, lowered.deployed
    final = run_dir / export_cfg.filename
    failed = final.with_name(final.stem + ".FAILED_PARITY.pte")
    pte_path = failed if checked.parity.reasons else final
    os.replace(lowered.pending, pte_path)
    if not checked.parity.reasons:
        failed.unlink(missing_ok=True)  # a stale failure from an earlier export of this run
    layers = quantized_layers(deployed)
    summary = RunSummary(
        run_dir=str(run_dir),
        model=trained.checkpoint,
        recipe=recipe.name,
        backend=recipe.backend,
        mode=trained.mode,
        quantized=recipe.quantized,
        seq_len=data.seq_len,
        eval_blocks=len(data.x),
        val_blocks=validation_blocks_id(data.x, data.y),
        distill=trained.distill,
        lora=trained.lora,
        metrics=checked.metrics,
        parity=checked.parity,
        pte=PteInfo(
            path=str(pte_path),
            size_bytes=pte_path.stat().st_size,
            max_seq_len=export_cfg.max_seq_len,
            export_path=export_path(deployed),
            fallback_reason=fallback_reason(deployed),
            kv_cache=kv_cache_dtype(deployed),
            sha256=hashlib.sha256(lowered.pte_bytes).hexdigest(),
        ),
        layers=None
        if layers is None
        else LayerPlan(layers, layer_counts(layers), [rule.raw for rule in recipe.layers]),
        coverage=graph_coverage(deployed),
        timings=timings,
    )
    summary.evaluations = earlier_evaluations(run_dir / "summary.json")
    summary.write(run_dir / "summary.json")
    print(format_table(summary))
    return summary


def bench_run(summary: RunSummary, trained: Trained, cfg: BenchConfig, run_dir: Path) -> None:
    """Benchmark the ``.pte`` (and, with ``bench.eager``, the eager FP model in a fresh process) into ``summary``."""
    from qharness.runtime.bench import bench, format_bench

    summary.bench = bench(
        Path(summary.pte.path),
        trained.model_dir if cfg.eager else None,
        cfg.prompt_len,
        cfg.decode_tokens,
        cfg.reps,
    )
    summary.write(run_dir / "summary.json")
    print(format_bench(summary.bench))


def non_finite_scores(metrics: dict, key: str) -> list[str]:
    """The gate's reason when model ``key``'s validation loss is NaN/inf (empty otherwise)."""
    names = {"converted": "the converted model", "pte": "the .pte"}
    loss = metrics[key]["loss"]
    return [] if math.isfinite(loss) else [f"{names[key]}'s validation loss is {loss} (stage: scoring {names[key]})"]


def against_fake_quant(trained: Trained, pte, data: HeldOut, metrics: dict, cfg: ParityConfig) -> dict:
    """The ``.pte`` against the trained fake-quant graph (QAT): ``compare_blocks`` over the first batch of validation
    blocks and the perplexity difference over all of them; ``gated`` (the verdict counts) when the run deploys
    learned scales, whose whole point is that the ``.pte`` is the trained model."""
    with stage(".pte vs trained fake-quant"):
        figures = compare_blocks(pte, trained.fake_quant, data.x[: data.batch_size], tie_margin=cfg.tie_margin)
    ref = metrics["fake_quant"]["ppl"]
    figures["ppl_rel_diff"] = abs(metrics["pte"]["ppl"] - ref) / ref
    figures["reasons"] = gate(figures, cfg, prefix="fake_quant_")
    figures["passed"] = not figures["reasons"]
    figures["gated"] = trained.weight_qparams is not None
    return figures


def evaluate_run(
    trained: Trained,
    data: HeldOut,
    fp_model,
    converted,
    pte_path,
    run_dir: Path,
    cfg: EvalConfig,
    filename: str = "eval.json",
) -> dict:
    """lm-eval of what a run has: the FP model, the QAT graph (``trained.fake_quant``), the converted model and the
    ``.pte``; prints the table and writes ``run_dir/<filename>``."""
    from qharness.evaluation.harness import evaluate_models, format_eval_table, max_length
    from qharness.evaluation.lm_eval_adapter import BatchedForward, converted_backend, hf_backend, pte_backend

    length = max_length(cfg, data.seq_len)
    backends = {"fp": lambda: hf_backend(fp_model, length, data.batch_size)}
    if trained.fake_quant is not None:
        backends["fake_quant"] = lambda: BatchedForward(
            trained.fake_quant, length, data.batch_size, shape=(data.batch_size, data.seq_len)
        )
    if converted is not None:
        backends["converted"] = lambda: converted_backend(converted, length)
    if pte_path is not None:
        backends["pte"] = lambda: pte_backend(pte_path, length)
    result = evaluate_models(
        backends,
        trained.tokenizer,
        cfg,
        data.texts(),
        run_dir,
        {"max_length": length, "pte": str(pte_path) if pte_path else None},
        filename,
    )
    print(format_eval_table(result))
    return result


def earlier_evaluations(path: Path) -> list[dict]:
    """The ``evaluations`` (later ``qharness evaluate`` results, each in its own file and naming the ``.pte`` it
    scored by ``pte_sha256``) of the summary a re-export replaces: a new program never drops them."""
    if not path.is_file():
        return []
    try:
        return RunSummary.read(path).evaluations
    except UserError:  # an unreadable summary is replaced; its evaluations' own files stay beside it
        return []
