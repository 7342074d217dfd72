"""What a run writes once the gate has judged the ``.pte``: its final name and ``summary.json`` (``write_summary``),
the benchmark (``bench_run``), lm-eval (``evaluate_run``) and the answer-quality check of chat runs (``answer_run``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from qharness.checks.answers import Answers, format_answers
from qharness.config import MODEL_KINDS, BenchConfig, EvalConfig, ExportConfig
from qharness.errors import UserError
from qharness.run.gate import Checked
from qharness.run.stages import Lowered
from qharness.run.summary import LayerPlan, PteInfo, RunSummary, Timings
from qharness.run.table import format_table
from qharness.run.trained import HeldOut, Trained
from qharness.runtime.pte import data_file, move_program, program_bytes


def validation_blocks_id(x: torch.Tensor, y: torch.Tensor) -> str:
    """A digest of the scored validation blocks: runs with the same one were scored on the very same tokens
    (same data, seq_len and eval_blocks), so their per-block losses pair up (``qharness report``)."""
    digest = hashlib.sha256()
    for t in (x, y):
        digest.update(str(tuple(t.shape)).encode())
        digest.update(t.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


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
    from qharness.sources.gguf import gguf_source

    recipe, deployed = trained.recipe, lowered.deployed
    final = run_dir / export_cfg.filename
    failed = final.with_name(final.stem + ".FAILED_PARITY.pte")
    pte_path = failed if checked.parity.reasons else final
    move_program(lowered.pending, pte_path)
    if not checked.parity.reasons:
        failed.unlink(missing_ok=True)  # a stale failure from an earlier export of this run
        data_file(failed).unlink(missing_ok=True)
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
        gguf=gguf_source(trained.checkpoint),
        distill=trained.distill,
        lora=trained.lora,
        metrics=checked.metrics,
        parity=checked.parity,
        pte=PteInfo(
            path=str(pte_path),
            size_bytes=program_bytes(pte_path),
            max_seq_len=export_cfg.max_seq_len,
            export_path=export_path(deployed),
            fallback_reason=fallback_reason(deployed),
            kv_cache=kv_cache_dtype(deployed),
            sha256=hashlib.sha256(lowered.pte_bytes).hexdigest(),
            structure=lowered.structure,
            data_file=data_file(pte_path).name if data_file(pte_path).is_file() else None,  # move_program's
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

    length = max_length(cfg, data.seq_len)
    backends = model_backends(trained, data, fp_model, converted, pte_path, length)
    result = evaluate_models(
        backends,
        trained.tokenizer,
        cfg,
        data.texts(),
        run_dir,
        {"max_length": length, "pte": str(pte_path) if pte_path else None},
        filename,
        chat_template(trained, data) if cfg.uses_chat_template(data.chat_data) else None,
    )
    print(format_eval_table(result))
    return result


def model_backends(trained: Trained, data: HeldOut, fp_model, converted, pte_path, length: int) -> dict:
    """``{kind: () -> backend}`` of what a run has, each seeing ``length`` tokens at once (built when called)."""
    from qharness.evaluation.lm_eval_adapter import BatchedForward, converted_backend, hf_backend, pte_backend

    backends = {"fp": lambda: hf_backend(fp_model, length, data.batch_size)}
    if trained.fake_quant is not None:
        backends["fake_quant"] = lambda: BatchedForward(
            trained.fake_quant, length, data.batch_size, shape=(data.batch_size, data.seq_len)
        )
    if converted is not None:
        backends["converted"] = lambda: converted_backend(converted, length)
    if pte_path is not None:
        backends["pte"] = lambda: pte_backend(pte_path, length)
    return backends


def chat_template(trained: Trained, data: HeldOut) -> str:
    """The chat template the run's chat data was rendered with, else the tokenizer's (``UserError`` without one)."""
    from qharness.sources.chat import check_template

    check_template(trained.tokenizer, data.chat_template, "data.chat_template (eval.chat_template is on)")
    return data.chat_template or trained.tokenizer.chat_template


def answer_run(
    trained: Trained, data: HeldOut, fp_model, converted, pte_path, cfg: EvalConfig, stop_ids: list[int]
) -> Answers | None:
    """The answer-quality check (``eval.answers``) of a chat/instruction run, or of any run given
    ``eval.answers.source``: prints its table; None when it does not apply or found no conversation."""
    from qharness.evaluation.answers import answer_check
    from qharness.evaluation.harness import max_length

    a = cfg.answers
    if not a.enabled or data.conversations is None or not (data.chat_data or a.source is not None):
        return None
    conversations = data.conversations(a.source, a.limit)
    length = max_length(cfg, data.seq_len)
    result = answer_check(
        model_backends(trained, data, fp_model, converted, pte_path, length),
        trained.tokenizer,
        conversations,
        chat_template(trained, data),
        a,
        length,
        stop_ids,
        a.source or "the held-out split of data.source",
        list(cfg.models),
        cfg.seed,
    )
    if result is not None:
        print(format_answers(result, MODEL_KINDS))
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
