"""The latency table of a run (``latency.json``, for ``autotune --max_latency_ms``): one variant ``.pte`` per scheme
(every unit at it, the rest of the program as autotune builds it), timed in one joint interleaved benchmark, each
profiled one decode step at a time, and apportioned per unit (``evaluation/latency.py``); then the chosen program
timed against the budget.

Variants are written to ``<run_dir>/latency/all-<scheme>.pte`` (atomically, kept: a killed run rebuilds only the
missing ones) and the table to ``latency.json`` (reused when it was measured for this model, unit, layers, base
recipe and cache length).

Example::

    lat = latency_table(module, data, RunSettings(Path("runs/x")), sensitivity_table, "xnnpack_8da4w", ["fp", "8da4w-pc"])
    timed = time_chosen(Path("runs/x/model.pte"), lat, Path("runs/x"), settings.bench)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from qharness.config import BenchConfig
from qharness.io.atomic import write_json_atomic
from qharness.run.from_lightning import trained
from qharness.run.summary import Timings
from qharness.run.trained import HeldOut
from qharness.run.workflows import RunSettings
from qharness.runtime.pte import move_program
from qharness.training.checkpoints import init_args
from qharness.training.module import QuantLM

VARIANT_DIR = "latency"
PROCESSES = 5  # fresh processes per program in each joint benchmark
PROFILE_STEPS = 16
FP_RECIPE = "xnnpack_fp32"  # the all-fp variant (its embedding fp32 too, as in an XNNPACK base without embedding_bits)  # decode steps per profiled repetition (3 repetitions)


def latency_table(
    model: QuantLM, data: HeldOut, settings: RunSettings, table: dict, base: str, schemes: list[str]
) -> dict:
    """The run directory's ``latency.json`` when it holds ``schemes`` for this model and layers, else measured: the
    variants built (those missing), timed jointly (``PROCESSES`` fresh processes each, ``settings.bench``'s lengths),
    profiled and apportioned; written atomically and returned."""
    from qharness.evaluation import latency as lat

    run_dir = Path(settings.run_dir)
    path = run_dir / lat.LATENCY_FILE
    wanted = {
        "model": model.hparams.checkpoint,
        "unit": table["unit"],
        "unit_names": [u["name"] for u in table["units"]],
        "base_recipe": base,
        "max_seq_len": settings.deploy.max_seq_len,
    }
    if path.is_file():
        cached = json.loads(path.read_text())
        why = lat.table_matches(cached, wanted)
        if why is None and set(schemes) <= set(cached["variants"]):
            print(f"[autotune] {path}: reused", flush=True)
            return cached
        print(f"[autotune] {path}: not reused ({why or 'schemes missing'}); measuring again", flush=True)
    programs = {s: variant_program(model, data, settings, table, base, s) for s in schemes}
    joint = time_jointly(programs, settings.bench)
    measured = {s: joint["programs"][s]["decode_ms_per_token"] for s in schemes}
    profiles = {s: decode_step_profile(p, settings.bench.prompt_len) for s, p in programs.items()}
    result = lat.apportion(measured, profiles, table["units"])
    for s in schemes:  # what waiting for a core does not move: CPU ms per token (recorded, not planned on)
        result["variants"][s]["cpu_ms_per_token"] = cpu_ms(joint["programs"][s])
    result.update(
        wanted,
        programs={s: str(p) for s, p in programs.items()},
        bench={k: joint[k] for k in ("processes", "threads", "prompt_len", "decode_tokens", "reps", "load_avg_1m")},
    )
    write_json_atomic(path, result)
    print(lat.format_table(result), flush=True)
    print(f"[autotune] latency table written: {path}", flush=True)
    return result


def variant_program(model: QuantLM, data: HeldOut, settings: RunSettings, table: dict, base: str, scheme: str) -> Path:
    """``<run_dir>/latency/all-<scheme>.pte``: every unit of ``table`` at ``scheme`` on ``base`` (PTQ; the weights
    do not matter for its time), exported and lowered without the parity gate (it is timed, never shipped)."""
    from qharness.deploy.lower import runner_metadata
    from qharness.evaluation import autotune as at
    from qharness.run.pipeline import eos_ids
    from qharness.run.stages import export_and_quantize, lower_and_write

    out = Path(settings.run_dir) / VARIANT_DIR
    final = out / f"all-{scheme}.pte"
    if final.is_file():
        return final
    units = table["units"]
    plan = at.Plan(
        schemes={u["name"]: scheme if scheme in at.options(u) else at.FP for u in units},  # fp where it cannot
        layers={u["name"]: list(u["layers"]) for u in units},
        unit=table["unit"],
        predicted_bytes=0,
        predicted_ppl_ratio=1.0,
        budget_bytes=None,
        rest_bytes=0,
        baseline_ppl=table["baseline"]["ppl"],
    )
    plan.rules = at.rules(plan, table["candidates"])
    if all(s == at.FP for s in plan.schemes.values()):  # a recipe keeping every layer float is refused: the FP one
        recipe = FP_RECIPE
    else:
        recipe = at.write_recipe(
            plan, out / f"all-{scheme}.yaml", base, f"qharness autotune (latency variant {scheme})"
        )
    variant = QuantLM(**{**init_args(model), "recipe": str(recipe), "mode": "ptq"})
    t = trained(variant)
    text_config = t.fp_model.config.get_text_config()
    metadata = runner_metadata(
        settings.deploy.max_seq_len,
        text_config.vocab_size,
        t.tokenizer.bos_token_id,
        eos_ids(t.fp_model, t.tokenizer, data.end_of_turn),
    )
    print(f"[autotune] latency variant: every {table['unit']} at {scheme}", flush=True)
    calibration = dataclasses.replace(data, calibration=data.calibration[: data.batch_size])  # time: not scales
    timings = Timings()
    deployed = export_and_quantize(t, calibration, settings.deploy, False, timings)
    lowered = lower_and_write(deployed, t, metadata, settings.deploy, out / scheme, timings)
    move_program(lowered.pending, final)
    return final


def time_jointly(programs: dict[str, Path], bench: BenchConfig) -> dict:
    """``runtime/joint.bench_jointly`` of ``programs`` (name -> ``.pte``), ``PROCESSES`` fresh processes each."""
    from qharness.runtime.joint import bench_jointly, format_joint

    joint = bench_jointly(
        list(programs.values()),
        prompt_len=bench.prompt_len,
        decode_tokens=bench.decode_tokens,
        reps=bench.reps,
        processes=PROCESSES,
        names=list(programs),
        log=lambda line: print(line, flush=True),
    )
    print(format_joint(joint), flush=True)
    return joint


def cpu_ms(program: dict) -> dict:
    """A joint benchmark program's decode CPU ms per token (``spread`` over its processes): ``1000 /`` tokens per
    CPU-second, the wall time the program would take with a core to itself."""
    from qharness.runtime.spread import spread

    return spread([1e3 / x for x in program["decode_tok_per_cpu_s"]["per_process"]])


def decode_step_profile(pte: Path, prompt_len: int) -> dict:
    """``{"linear_ms": [...], "total_ms": x}`` of one decode step of ``pte`` (medians over the profiled steps)."""
    from qharness.evaluation.latency import step_split
    from qharness.runtime.bench import pte_vocab
    from qharness.runtime.profile import decode_medians, traced_events

    vocab = pte_vocab(pte, prompt_len, PROFILE_STEPS, 3)
    events, reps, per_rep = traced_events(pte, vocab, prompt_len=prompt_len, decode_tokens=PROFILE_STEPS)
    ms = decode_medians(events, reps, per_rep)
    linear, total = step_split([e["name"] for e in events], [e["delegated"] for e in events], ms)
    return {"linear_ms": linear, "total_ms": total}


def time_chosen(pte: Path, latency: dict, max_latency_ms: float | None, bench: BenchConfig) -> dict:
    """The chosen ``.pte`` timed jointly with the latency table's variants: its decode ms/token spread, the
    variants' spreads now (against the table's: how far this session's machine moved) and the verdict against
    ``max_latency_ms`` (``MET`` only when the whole spread is within it)."""
    from qharness.runtime.spread import verdict

    programs = {"chosen": pte, **{f"all-{s}": Path(p) for s, p in latency["programs"].items()}}
    joint = time_jointly(programs, bench)
    ms = {name: joint["programs"][name]["decode_ms_per_token"] for name in programs}
    return {
        "measured_ms_per_token": ms["chosen"],
        "cpu_ms_per_token": cpu_ms(joint["programs"]["chosen"]),
        "cpu_share": joint["programs"]["chosen"]["decode_cpu_share"],
        "variants_now": {name: s for name, s in ms.items() if name != "chosen"},
        "verdict": None if max_latency_ms is None else verdict(ms["chosen"], max_latency_ms, higher_is_better=False),
        "load_avg_1m": joint["load_avg_1m"],
        "threads": joint["threads"],
    }
