"""Per-layer precision jobs of a run config: ``sensitivity`` (the per-layer perplexity cost of each candidate scheme)
and ``autotune`` (a per-layer recipe under a ``.pte`` size budget, then run like ``calibrate`` or ``fit``), as plain
functions of the ``QuantLM`` module, the ``TextDataModule`` and the run's settings (``run/workflows.RunSettings``).

Example::

    table = sensitivity(module, datamodule, RunSettings(Path("runs/ptq")), candidates="fp,8da4w-g32")
    record = autotune(module, datamodule, RunSettings(Path("runs/ptq")), max_size_mb=2.0)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from qharness.data.datamodule import TextDataModule
from qharness.errors import UserError
from qharness.io.atomic import write_json_atomic
from qharness.run.from_lightning import held_out
from qharness.run.results import validation_blocks_id
from qharness.run.summary import RunSummary
from qharness.run.trained import HeldOut
from qharness.run.workflows import OnSummary, RunSettings, deploy
from qharness.training.checkpoints import init_args
from qharness.training.module import QuantLM

# QAT autotune: train the tuned module (``QTrainer`` fits it, saves last.ckpt and gathers the graph)
Train = Callable[[QuantLM, TextDataModule], None]


def sensitivity(
    model: QuantLM,
    datamodule: TextDataModule,
    settings: RunSettings,
    candidates: str | None = None,
    unit: str = "layer",
    against: str = "fp",
) -> dict:
    """Per-layer quantization cost: the validation perplexity change (converted model, ``parity.eval_blocks``
    blocks, paired 95% band) of each layer or decoder block at each candidate precision; writes sensitivity.json,
    .md and .png into the run directory, prints the table and returns it (``evaluation/sensitivity.py``)."""
    from qharness.evaluation.sensitivity import check_options

    names = check_options(model.recipe, candidates, unit, against)
    datamodule.setup("fit")
    data = held_out(datamodule, settings.parity, settings.calibration)
    fp_model, _ = model.load_fp()
    return sensitivity_table(model, fp_model, data, names, unit, against, Path(settings.run_dir))


def sensitivity_table(
    model: QuantLM, fp_model, data: HeldOut, names: list[str], unit: str, against: str, run_dir: Path
) -> dict:
    """Measure the sensitivity table of ``fp_model`` on the held-out ``data``, record which model and blocks it
    was measured on, write sensitivity.json/.md/.png into ``run_dir`` and print the table."""
    from qharness.evaluation.sensitivity import format_table, measure, write_outputs

    result = measure(fp_model, model.recipe, data.x, data.y, data.batch_size, names, unit, against)
    result.update(model=model.hparams.checkpoint, val_blocks=validation_blocks_id(data.x, data.y))
    paths = write_outputs(result, run_dir)
    print(format_table(result))
    print(f"written: {paths['json']}, {paths['table']}, {paths['png']}")
    return result


def autotune(
    model: QuantLM,
    datamodule: TextDataModule,
    settings: RunSettings,
    max_size_mb: float | None = None,
    sensitivity: str | None = None,
    candidates: str | None = None,
    unit: str = "layer",
    train: Train | None = None,
    on_summary: OnSummary | None = None,
    command: str = "qharness autotune",
    max_latency_ms: float | None = None,
) -> dict:
    """Per-layer precision under a ``.pte`` size budget (``max_size_mb``) and/or a decode latency budget
    (``max_latency_ms``, ms/token): measure (or reuse ``sensitivity``, else the run directory's) the sensitivity
    table against FP, with a latency budget the latency table too (``run/latency.py``), pick each layer's scheme
    (exact knapsack), write it as ``autotuned.yaml``, then run it like ``calibrate`` (PTQ) or ``fit`` (QAT: ``train``
    trains it), time it against the latency budget, and write ``autotune.json`` (the plan, predicted vs measured
    size and latency; ``command`` recorded); returns that record."""
    from qharness.evaluation import autotune as at
    from qharness.evaluation.latency import check_latency_budget
    from qharness.evaluation.sensitivity import check_options, scheme_recipe, shared_table_bytes, unit_sizes

    budget = at.check_budget(max_size_mb, max_latency_ms)
    max_latency_ms = check_latency_budget(max_latency_ms)
    names = check_options(model.recipe, candidates, unit, "fp")
    run_dir = Path(settings.run_dir)
    scheme = scheme_recipe(model.recipe, "fp")
    datamodule.setup("fit")
    data = held_out(datamodule, settings.parity, settings.calibration)
    fp_model, _ = model.load_fp()
    shared = shared_table_bytes(fp_model, model.recipe, names)  # a tied head's values kept once with its table
    sizes = at.share_tables({"units": unit_sizes(fp_model, model.recipe, names, unit)}, shared)
    rest = at.rest_bytes(fp_model, sizes, settings.deploy.max_seq_len, scheme)
    if budget is not None:
        at.check_fits(sizes, budget, rest)  # before any measuring: a budget nothing fits fails now
    path = Path(sensitivity) if sensitivity else run_dir / "sensitivity.json"
    table = reusable_table(path, bool(sensitivity), model, data, unit, scheme.name, names)
    if table is None:
        table = sensitivity_table(model, fp_model, data, names, unit, "fp", run_dir)
    table = at.share_tables(at.only_candidates(table, names), shared)
    del fp_model
    base = model.hparams.recipe if scheme is model.recipe else scheme.name
    base = str(Path(base).resolve()) if Path(base).suffix in (".yaml", ".yml") else base
    latency = None
    if max_latency_ms is not None:
        from qharness.run.latency import latency_table

        schemes = [at.FP, *(c for c in table["candidates"] if c != at.FP)]
        latency = latency_table(model, data, settings, table, base, schemes)
        at.check_fast_enough(table, latency, max_latency_ms)  # before the plan's calibration and export
    plan, summary, correction = run_plans(
        model, datamodule, settings, table, budget, rest, base, command, train, on_summary, latency, max_latency_ms
    )
    measured, recipe_path = summary.pte.size_bytes, run_dir / at.RECIPE_FILE
    ppl = summary.metrics["pte"].ppl
    record = {
        **plan.to_dict(),
        "command": command,
        "recipe": str(recipe_path),
        "sensitivity": str(path) if sensitivity or (run_dir / "sensitivity.json").is_file() else None,
        "measured_size_bytes": measured,
        "measured_ppl_pte": ppl,
        "rest_correction_bytes": correction,
        "within_budget": budget is None or measured <= budget,
    }
    if latency is not None:
        record.update(timed_against_budget(Path(summary.pte.path), plan, latency, settings, run_dir))
    write_json_atomic(run_dir / at.PLAN_FILE, record)
    print(
        f"[autotune] .pte ppl {ppl:.3f} (predicted {plan.predicted_ppl:.3f}); plan: {run_dir / at.PLAN_FILE}; "
        f"run it again: qharness {'fit' if model.hparams.mode == 'qat' else 'calibrate'} CONFIG --model.recipe {recipe_path}"
    )
    if budget is not None and measured > budget:
        raise UserError(
            f"the .pte is {measured:,} bytes, over --max_size_mb {budget / 1e6:g} (predicted {plan.predicted_bytes:,})",
            fix=f"lower --max_size_mb by about {(measured - budget) / 1e6:.3f}, or edit {recipe_path} and run it "
            "with qharness calibrate",
        )
    return record


def timed_against_budget(pte: Path, plan, latency: dict, settings: RunSettings, run_dir: Path) -> dict:
    """The chosen ``.pte`` timed jointly with the latency variants (``run/latency.time_chosen``), printed against the
    prediction and the budget; the record's ``measured_ms_per_token`` (spread), ``latency_verdict`` and the rest."""
    from qharness.evaluation.latency import LATENCY_FILE
    from qharness.run.latency import PROCESSES, time_chosen
    from qharness.runtime.spread import format_spread

    timed = time_chosen(pte, latency, plan.max_latency_ms, settings.bench)
    s = timed["measured_ms_per_token"]
    err = (s["median"] - plan.predicted_ms) / plan.predicted_ms
    print(
        f"[autotune] decode latency: predicted {plan.predicted_ms:.4f} ms/token, measured {format_spread(s, '.4f')} "
        f"(median {err:+.1%} vs predicted; median (min-max) of {PROCESSES} fresh processes, timed jointly with the "
        f"all-one-scheme programs; CPU share {timed['cpu_share']['median']:.2f}, CPU "
        f"{timed['cpu_ms_per_token']['median']:.4f} ms/token); budget {plan.max_latency_ms:g}: {timed['verdict']}",
        flush=True,
    )
    return {
        "latency": str(run_dir / LATENCY_FILE),
        "measured_ms_per_token": s,
        "latency_error": err,
        "latency_verdict": timed["verdict"],
        "measured_cpu_ms_per_token": timed["cpu_ms_per_token"],
        "latency_cpu_share": timed["cpu_share"],
        "latency_variants_now": timed["variants_now"],
        "latency_load_avg_1m": timed["load_avg_1m"],
    }


def reusable_table(
    path: Path, given: bool, model: QuantLM, data: HeldOut, unit: str, recipe: str, candidates: list[str]
) -> dict | None:
    """The sensitivity table at ``path`` when it was measured on this model, these validation blocks, ``unit`` and
    scheme ``recipe`` against FP, with a column for each of ``candidates``; else None (measure again), or, when the
    user ``given`` it, a ``UserError``."""
    from qharness.evaluation import autotune as at

    if not path.is_file():
        if given:
            raise UserError(f"--sensitivity {path} does not exist", fix="run qharness sensitivity CONFIG first")
        return None
    table = json.loads(path.read_text())
    val = validation_blocks_id(data.x, data.y)
    why = at.table_matches(table, model.hparams.checkpoint, len(data.x), data.seq_len, val, unit, recipe, candidates)
    if why and given:
        raise UserError(
            f"--sensitivity {path} does not fit this config: {why}",
            fix="leave --sensitivity out (autotune measures the table), or measure it with this config",
        )
    print(f"[autotune] {path}: " + (f"not reused ({why}); measuring again" if why else "reused"), flush=True)
    return None if why else table


def run_plans(
    model: QuantLM,
    datamodule: TextDataModule,
    settings: RunSettings,
    table: dict,
    budget: int,
    rest: int,
    base: str,
    command: str,
    train: Train | None,
    on_summary: OnSummary | None,
    latency: dict | None = None,
    max_latency_ms: float | None = None,
) -> tuple:
    """Plan (under ``budget`` bytes and/or ``max_latency_ms`` with the ``latency`` table), write ``autotuned.yaml``
    and run it; a PTQ ``.pte`` over the size budget is planned once more with the rest corrected by the measured
    error. Returns ``(plan, summary, correction)``."""
    from qharness.evaluation import autotune as at

    recipe_path = Path(settings.run_dir) / at.RECIPE_FILE
    correction, plan, summary = 0, None, None
    for attempt in (1, 2):
        plan = at.choose(table, budget, rest + correction, latency=latency, max_latency_ms=max_latency_ms)
        at.check_not_all_fp(plan)
        print(at.format_plan(plan, table, latency), flush=True)
        at.write_recipe(plan, recipe_path, base, command)
        print(f"[autotune] recipe written: {recipe_path}", flush=True)
        tuned = QuantLM(**{**init_args(model), "recipe": str(recipe_path)})
        if tuned.hparams.mode == "qat":
            if train is None:
                raise ValueError("QAT autotune needs train=")
            train(tuned, datamodule)
        summary: RunSummary = deploy(tuned, datamodule, settings, on_summary)
        measured = summary.pte.size_bytes
        print(
            f"[autotune] .pte size: predicted {plan.predicted_bytes:,} bytes, measured {measured:,} "
            f"({(measured - plan.predicted_bytes) / plan.predicted_bytes:+.2%})"
            + ("" if budget is None else f"; budget {budget:,}"),
            flush=True,
        )
        if budget is None or measured <= budget or attempt == 2 or tuned.hparams.mode == "qat":
            break
        correction = measured - plan.predicted_bytes
        print(f"[autotune] over the budget: planning again with the rest corrected by {correction:+,} bytes")
    return plan, summary, correction
