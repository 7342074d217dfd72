"""The deploy stages before the gate: the trained models scored, the converted static-KV-cache graph, the
``.pte`` lowered and written as ``<name>.pending.pte`` (``run/pipeline.deploy_and_check`` chains them)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qharness.checks.parity import score_batched
from qharness.config import ExportConfig
from qharness.deploy.deployed import mark_shared_tables
from qharness.errors import UserError
from qharness.io.atomic import atomic_dir, write_bytes_atomic
from qharness.progress import stage
from qharness.run.summary import Timings
from qharness.run.trained import HeldOut, Trained, deploy_graph
from qharness.sources.chat import save_template


@dataclass
class Lowered:
    """What lowering hands the checks: the converted graph, the program's bytes, the file they wait in for the
    gate (``<name>.pending.pte``) and the program's structure digest (``deploy/structure.py``)."""

    deployed: torch.fx.GraphModule
    pte_bytes: bytes
    pending: Path
    structure: str | None = None


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
    chat_template: str | None = None,
) -> Lowered:
    """Lower ``deployed`` to ExecuTorch with the runner's ``metadata``, write it as ``<name>.pending.pte`` (not the
    name anyone ships; a tied table stored once goes to its data file ``<name>.pending.ptd``, written first) and the
    tokenizer beside it, with ``chat_template`` (the run's ``data.chat_template``) as its template, so ``qharness
    generate --chat`` renders what training rendered."""
    from qharness.deploy.lower import lower_program
    from qharness.runtime.pte import data_file

    recipe, tokenizer = trained.recipe, trained.tokenizer
    t = time.perf_counter()
    with stage(f"lowering to ExecuTorch ({recipe.name}, {recipe.backend})"):
        program = lower_program(deployed, recipe, export_cfg.max_seq_len, metadata, share_tables=True)
    timings.lower_s = time.perf_counter() - t
    final = run_dir / export_cfg.filename
    pending = final.with_name(final.stem + ".pending.pte")
    if program.data is not None:
        write_bytes_atomic(data_file(pending), program.data)
        mark_shared_tables(deployed, data_file(final).name)
    else:
        data_file(pending).unlink(missing_ok=True)  # a stale one of an earlier export
    write_bytes_atomic(pending, program.pte)
    with atomic_dir(run_dir / "tokenizer") as tokenizer_dir:
        tokenizer.save_pretrained(tokenizer_dir)
        if chat_template is not None:
            save_template(tokenizer_dir, chat_template)
    return Lowered(deployed, program.pte, pending, program.structure)
