"""A checked sweep config -> its runs in order (baseline first), each with its merged config and run directory."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from qharness.config import deep_merge
from qharness.errors import UserError
from qharness.io.names import check_inside, check_name
from qharness.sweep.spec import mapping

SUBCOMMAND = {"qat": "fit", "ptq": "calibrate"}
AUTOTUNED = "autotuned"  # the recipe name of an autotune run (its recipe file autotuned.yaml)


@dataclass
class SweepRun:
    """One run of a sweep: ``qharness <subcommand> --config <run_dir>/sweep_config.yaml``."""

    name: str
    recipe: str
    mode: str
    config: dict
    run_dir: Path
    autotune: bool = False

    @property
    def subcommand(self) -> str:
        return "autotune" if self.autotune else SUBCOMMAND[self.mode]

    @property
    def summary_recipe(self) -> str:
        """The recipe name the run's summary.json records."""
        return AUTOTUNED if self.autotune else Path(self.recipe).stem

    @property
    def config_path(self) -> Path:
        return self.run_dir / "sweep_config.yaml"

    def digest(self) -> str:
        return hashlib.sha256(json.dumps([self.subcommand, self.config], sort_keys=True).encode()).hexdigest()


def depends_on(run: SweepRun, earlier: SweepRun) -> bool:
    """Whether ``run``'s config names a path inside ``earlier``'s run directory (a recipe file it wrote, a teacher it
    trained), so that ``run`` must wait for it when runs go in parallel. A run does not depend on itself."""
    where = earlier.run_dir.resolve()
    if where == run.run_dir.resolve():
        return False

    def names(value) -> bool:
        if isinstance(value, dict):
            return any(names(v) for v in value.values())
        if isinstance(value, list | tuple):
            return any(names(v) for v in value)
        return isinstance(value, str) and bool(value) and Path(value).resolve().is_relative_to(where)

    return names(run.config) or names(run.recipe)


def plan(spec: dict) -> list[SweepRun]:
    """The runs of a sweep, baseline first; each config is the shared one, the run's own, then recipe/mode/run dir."""
    from qharness.recipes.registry import load_recipe

    sweep_dir = Path(spec["sweep_dir"])
    entries = ([{"recipe": spec["baseline"], "modes": ["ptq"]}] if spec.get("baseline") else []) + spec["runs"]
    runs, names = [], set()
    for entry in entries:
        modes = entry.get("modes", [entry["mode"]] if "mode" in entry else None)
        if not modes or not isinstance(modes, list):
            raise UserError(f"sweep run {entry['recipe']} names no modes", fix="add modes: [ptq, qat] (or mode: ptq)")
        recipe = load_recipe(entry["recipe"])
        for mode in modes:
            if mode not in SUBCOMMAND:
                raise UserError(f"sweep run {entry['recipe']}: unknown mode {mode!r}", fix="use ptq or qat")
            recipe.check_mode(mode)
            tune = entry.get("autotune")
            name = check_name(run_name(entry, mode), f"sweep run {entry['recipe']}: run name", "int8_distill")
            if name in names:
                if _baseline_again(name, entry, runs):
                    continue  # the baseline listed again among the runs
                raise UserError(
                    f"sweep runs: two runs would be named {name} (same run directory)",
                    fix="give one of them a name: e.g. {recipe: ..., name: my_variant, config: {...}}",
                )
            names.add(name)
            check_inside(name, sweep_dir, f"sweep run {name}: its run directory", "remove what links it elsewhere")
            config = run_config(spec["config"], entry, name, mode, sweep_dir / name, first=not runs)
            runs.append(SweepRun(name, entry["recipe"], mode, config, sweep_dir / name, autotune=bool(tune)))
    check_report_metric(spec["report"].get("metric", "ppl"), runs)
    return runs


def run_name(entry: dict, mode: str) -> str:
    """A sweep entry's run name in ``mode``: its ``name``, else its recipe's (an autotune entry's: its budgets'), then
    the mode: ``xnnpack_8da4w-ptq``, ``autotune_1.6mb-ptq``, ``int8_distill-qat``."""
    tune = entry.get("autotune")
    return f"{entry.get('name') or (autotune_name(tune) if tune else Path(entry['recipe']).stem)}-{mode}"


def autotune_name(tune: dict) -> str:
    """An autotune entry's default run name from its budgets: ``autotune_1.6mb``, ``autotune_0.6ms``,
    ``autotune_1.6mb_0.6ms``."""
    parts = [f"{tune[k]:g}{unit}" for k, unit in (("max_size_mb", "mb"), ("max_latency_ms", "ms")) if tune.get(k)]
    return "_".join(["autotune", *parts])


def _baseline_again(name: str, entry: dict, runs: list[SweepRun]) -> bool:
    """Whether ``entry`` (whose run would be named ``name``) is the baseline listed again among the runs."""
    baseline = runs[0] if runs else None
    return (
        baseline is not None
        and name == baseline.name
        and not entry.get("config")
        and _same_recipe(entry["recipe"], baseline.recipe)
    )


def run_config(shared: dict, entry: dict, name: str, mode: str, run_dir: Path, first: bool) -> dict:
    """The config of one run: the shared one, the entry's own over it, then its recipe, mode and run directory, its
    wandb group, lm-eval's models and (after the ``first`` run) no eager benchmark; an autotune entry's options."""
    config = deep_merge(shared, mapping(entry.get("config"), f"sweep run {name}: config"))
    config = deep_merge(
        config,
        {"model": {"recipe": entry["recipe"], "mode": mode}, "trainer": {"default_root_dir": str(run_dir)}},
    )
    config.setdefault("wandb", {}).setdefault("group", run_dir.parent.name)
    # lm-eval: the FP model once (the baseline run), then each run's trained fake-quant model (QAT) and
    # .pte; the converted model, which would stand in for PTQ's fake-quant, matches the .pte (parity gate)
    config.setdefault("eval", {}).setdefault(
        "models", (["fp"] if first else ["fake_quant"] if mode == "qat" else []) + ["pte"]
    )
    if not first:  # the eager FP model is the same in every run: benchmarked once, in the first (baseline) run
        config.setdefault("bench", {}).setdefault("eager", False)
    if entry.get("autotune"):  # autotune's options are top-level keys of its run config
        config.update(entry["autotune"])
    return config


def check_report_metric(metric, runs: list[SweepRun]) -> None:
    """``report.metric`` against what the runs will record (their lm-eval tasks), before any run starts: a metric no
    run has would otherwise be found only by the report, after all runs."""
    from qharness.config import EvalConfig
    from qharness.reporting.metric import check_metric

    default = EvalConfig()
    tasks = {}
    for run in runs:
        section = run.config.get("eval") if isinstance(run.config.get("eval"), dict) else {}
        if section.get("enabled", default.enabled):
            given = section.get("tasks", default.tasks)
            tasks |= dict.fromkeys(given if isinstance(given, list) else [given])
    check_metric(metric, [str(t) for t in tasks], "sweep config: report.metric")


def _same_recipe(a: str, b: str) -> bool:
    """Whether two recipe names of a sweep config name the same recipe (a name, or a path to its YAML)."""
    from qharness.recipes.registry import load_recipe

    return a == b or load_recipe(a) == load_recipe(b)
