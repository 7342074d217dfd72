"""The tail of every run: deploy (export -> quantize -> lower -> ``.pte``), parity gate, summary, chained.

``deploy_and_check`` chains the stages (``run/stages.py``, ``run/gate.py``, ``run/results.py``) over plain inputs
(``run/trained.py``: ``Trained``, ``HeldOut``); Lightning's side (``run/from_lightning.py``) builds them from the
LightningModule and the DataModule.
"""

from __future__ import annotations

import time
from pathlib import Path

from qharness.checks.parity import BREAKS_MODEL, UNSTABLE
from qharness.config import BenchConfig, EvalConfig, ExportConfig, ParityConfig
from qharness.errors import ParityError, UserError
from qharness.run.gate import TRAINED_CHECK, check_parity
from qharness.run.results import answer_run, bench_run, evaluate_run, write_summary
from qharness.run.stages import export_and_quantize, lower_and_write, score_trained
from qharness.run.summary import RunSummary, Timings
from qharness.run.trained import HeldOut, Trained, with_rounding
from qharness.schema.run import check_max_seq_len
from qharness.upstream import process

# what a user can do when the gate refuses a program: the gate compares it with the model it was lowered from
PARITY_FIX = (
    "the program does not compute what its converted model computes beyond that model's own rounding noise; try "
    "another recipe of the same size (qharness recipes), or let qharness ship pick one that passes; the refused "
    "program is kept for inspection"
)
# ... and, QAT, with the fake-quant model it trained: a refusal of that check alone
TRAINED_FIX = (
    "the program computes its converted model, but not what QAT trained (its fake-quant model): the recipe trains "
    "other numerics than it ships; the trained checkpoint is kept (qharness export CONFIG --ckpt_path last deploys "
    "it again); train with another recipe (qharness recipes), or let qharness ship pick one that passes; the "
    "refused program is kept for inspection"
)


# ... and where the recipe ruined the model the program was lowered from: no program of it can be checked
BROKEN_FIX = (
    "the recipe breaks this model, so whether the program computes it decides nothing (see its perplexity against "
    "FP); use a recipe with more bits, or QAT, or let qharness ship pick one within a tolerance of FP; the refused "
    "program is kept for inspection"
)


def parity_fix(reasons: list[str]) -> str:
    """What to try after the gate refused a program for ``reasons``."""
    if any(r.startswith((BREAKS_MODEL, UNSTABLE)) for r in reasons):
        return BROKEN_FIX
    trained_only = reasons and all(r.startswith(TRAINED_CHECK) for r in reasons)
    return TRAINED_FIX if trained_only else PARITY_FIX


def check_export_config(cfg: ExportConfig, seq_len: int, context: int | None) -> None:
    check_max_seq_len(cfg.max_seq_len, seq_len)
    if context is not None and cfg.max_seq_len > context:
        raise UserError(
            f"deploy.max_seq_len={cfg.max_seq_len} exceeds the model's context ({context})",
            fix=f"set deploy.max_seq_len <= {context}",
        )


def eos_ids(model, tokenizer, end_of_turn: list[int] = ()) -> list[int]:
    """EOS ids of the tokenizer and of the model's generation config (an id or a list), and ``end_of_turn``: a chat
    template's end-of-turn tokens (``<|im_end|>``, ``<|eot_id|>``) when the run trained on chat/instruction data, so
    the runner stops at the end of an answer."""
    config_eos = getattr(model.generation_config, "eos_token_id", None)
    ids = config_eos if isinstance(config_eos, list) else [config_eos]
    return sorted({i for i in [*ids, tokenizer.eos_token_id, *end_of_turn] if i is not None})


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
    ``lower_and_write`` -> ``check_parity`` -> ``write_summary`` -> ``bench_run`` -> ``evaluate_run`` ->
    ``answer_run`` (chat/instruction runs: greedy answers to held-out conversations, summary ``answers``).

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
    metadata_eos = eos_ids(trained.fp_model, tokenizer, data.end_of_turn)  # where the runner (and answers) stop
    metadata = runner_metadata(export_cfg.max_seq_len, text_config.vocab_size, tokenizer.bos_token_id, metadata_eos)
    timings = Timings(**(trained.train_time or {}))
    t = time.perf_counter()
    trained = with_rounding(trained, data.calibration)
    if trained.mode == "ptq" and trained.weight_qparams is not None:
        timings.rounding_s = time.perf_counter() - t
    scores = score_trained(trained, data)
    keep_fp = eval_cfg.enabled  # lm-eval scores the FP model after the .pte is written
    fp_model = trained.fp_model
    deployed = export_and_quantize(trained, data, export_cfg, keep_fp, timings)
    if not keep_fp:  # the deployed graph holds the weights it uses; the FP copies of quantized ones go
        fp_model = trained.fp_model = None
    lowered = lower_and_write(deployed, trained, metadata, export_cfg, run_dir, timings, data.chat_template)
    checked = check_parity(trained, lowered, data, parity_cfg, scores, timings)
    summary = write_summary(trained, data, lowered, checked, run_dir, export_cfg, timings)
    if summary.parity.reasons:
        raise ParityError(
            f"parity gate failed for {summary.pte.path}: "
            + "; ".join(summary.parity.reasons)
            + ". fix: "
            + parity_fix(summary.parity.reasons)
        )
    if bench_cfg.enabled and trained.recipe.runs_here:
        bench_run(summary, trained, bench_cfg, run_dir)
    if eval_cfg.enabled:
        pte_path = Path(summary.pte.path) if trained.recipe.runs_here else None
        summary.eval = evaluate_run(trained, data, fp_model, checked.reference, pte_path, run_dir, eval_cfg)
        summary.answers = answer_run(trained, data, fp_model, checked.reference, pte_path, eval_cfg, metadata_eos)
        summary.write(run_dir / "summary.json")
    return summary
