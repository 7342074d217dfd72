"""``qharness autotune --max_latency_ms``: the per-unit latency table apportioned from whole programs and their
profiles, the plan of least cost under a latency budget (and under both budgets), the one-line refusals, and the
option's validation before torch loads."""

import itertools
import json
import math
import re
import subprocess
import sys

import pytest
from conftest import ROOT, run_cli, write_config
from test_autotune import COSTS, SIZES, _table

from qharness.errors import UserError
from qharness.evaluation import autotune as at
from qharness.evaluation import latency as lat

# decode ms/token of each unit at each scheme, and the rest of the program: "a" is the slow unit (a big head)
MS = {
    "a": {"fp": 0.40, "8da8w-pc": 0.20, "8da4w-g32": 0.12, "8da4w-pc": 0.10},
    "b": {"fp": 0.10, "8da8w-pc": 0.05, "8da4w-g32": 0.04, "8da4w-pc": 0.03},
    "c": {"fp": 0.10, "8da8w-pc": 0.05, "8da4w-g32": 0.04, "8da4w-pc": 0.03},
    "d": {"fp": 0.10, "8da8w-pc": 0.05, "8da4w-g32": 0.04, "8da4w-pc": 0.03},
}
BASE_MS = 0.5
REST = 1000


def _latency(ms=MS, base=BASE_MS) -> dict:
    return {"base_ms": base, "units": [{"name": u, "layers": [u], "ms": dict(v)} for u, v in ms.items()]}


def _sensitivity() -> dict:
    return _table(COSTS, {u: SIZES for u in COSTS})


def _brute_force(table, latency, budget_bytes, rest, max_ms):
    """The least summed log cost (ties: fewer bytes) over every assignment within both budgets (None: unset)."""
    opts = [at.options(u) for u in table["units"]]
    ms = [{s: v for s, v in MS[u["name"]].items()} for u in table["units"]]
    best = (math.inf, math.inf, None)
    for picks in itertools.product(*[list(o.items()) for o in opts]):
        nbytes = rest + sum(b for _, (b, _) in picks)
        total_ms = latency["base_ms"] + sum(m[s] for m, (s, _) in zip(ms, picks))
        if (budget_bytes is None or nbytes <= budget_bytes) and (max_ms is None or total_ms <= max_ms + 1e-12):
            key = (round(sum(c for _, (_, c) in picks), 12), nbytes)
            if key < best[:2]:
                best = (*key, [s for s, _ in picks])
    return best


@pytest.mark.fast
@pytest.mark.parametrize("max_ms", [0.695, 0.705, 0.725, 0.755, 0.805, 0.905, 1.005, 1.205])
def test_the_plan_under_a_latency_budget_is_the_exact_least_cost_assignment_that_fits(max_ms):
    table, latency = _sensitivity(), _latency()
    plan = at.choose(table, None, REST, latency=latency, max_latency_ms=max_ms)
    cost, nbytes, _ = _brute_force(table, latency, None, REST, max_ms)
    assert round(math.log(plan.predicted_ppl_ratio), 12) == cost and plan.predicted_bytes == nbytes
    assert plan.predicted_ms <= max_ms
    assert plan.predicted_ms == pytest.approx(BASE_MS + sum(MS[u][s] for u, s in plan.schemes.items()))


@pytest.mark.fast
def test_a_tight_latency_budget_moves_the_slow_sensitive_unit_down_only_as_far_as_needed():
    """0.745 ms: every unit at 8-bit is 0.85 ms. The slow, sensitive unit "a" goes to 4-bit in groups (its per-channel
    4-bit costs more), "c" (whose 4-bit costs ~1%) keeps 8-bit, "b" and "d" (4-bit nearly free) go to 4-bit."""
    plan = at.choose(_sensitivity(), None, REST, latency=_latency(), max_latency_ms=0.745)
    assert plan.schemes == {"a": "8da4w-g32", "b": "8da4w-pc", "c": "8da8w-pc", "d": "8da4w-g32"}
    assert "predicted decode 0.7400 ms/token (budget 0.745 ms/token)" in at.format_plan(
        plan, _sensitivity(), _latency()
    )


@pytest.mark.fast
@pytest.mark.parametrize(
    "budget_bytes,max_ms", [(3300, 0.755), (3600, 0.705), (4100, 0.725), (4800, 0.805), (9000, 0.905), (3300, 1.005)]
)
def test_under_both_budgets_the_plan_is_the_exact_least_cost_assignment_within_both(budget_bytes, max_ms):
    table, latency = _sensitivity(), _latency()
    plan = at.choose(table, budget_bytes, REST, latency=latency, max_latency_ms=max_ms)
    cost, nbytes, _ = _brute_force(table, latency, budget_bytes, REST, max_ms)
    assert round(math.log(plan.predicted_ppl_ratio), 12) == cost and plan.predicted_bytes == nbytes
    assert plan.predicted_bytes <= budget_bytes and plan.predicted_ms <= max_ms


@pytest.mark.fast
def test_an_impossible_latency_budget_is_one_line_naming_the_fastest():
    with pytest.raises(UserError) as e:
        at.choose(_sensitivity(), None, REST, latency=_latency(), max_latency_ms=0.6)
    message = str(e.value)
    assert "\n" not in message
    assert "--max_latency_ms 0.6 is below the fastest program these candidates allow, about 0.6900 ms/token" in message
    assert "fix: use --max_latency_ms 0.6900 or more" in message


# a machine where 8-bit kernels are the fastest: the fastest program is not the smallest
MS_8BIT_FAST = {u: {"fp": 0.1, "8da8w-pc": 0.02, "8da4w-g32": 0.04, "8da4w-pc": 0.03} for u in MS}


@pytest.mark.fast
def test_budgets_that_fit_alone_but_not_together_name_the_fastest_within_the_size():
    """All at 8-bit is the fastest (0.58 ms) but 5,160 bytes; within 3,300 bytes at most one unit can be 8-bit. Each
    budget alone has a plan, together none: one line naming the fastest program within the size budget."""
    table, latency = _sensitivity(), _latency(MS_8BIT_FAST)
    at.choose(table, 3300, REST, latency=latency)
    at.choose(table, None, REST, latency=latency, max_latency_ms=0.585)
    opts = [at.options(u) for u in table["units"]]
    fastest_within = min(
        BASE_MS + sum(MS_8BIT_FAST[u["name"]][s] for u, (s, _) in zip(table["units"], picks))
        for picks in itertools.product(*[list(o.items()) for o in opts])
        if REST + sum(b for _, (b, _) in picks) <= 3300
    )
    with pytest.raises(UserError) as e:
        at.choose(table, 3300, REST, latency=latency, max_latency_ms=0.585)
    message = str(e.value)
    assert "\n" not in message and "no assignment fits both --max_size_mb 0.0033 and --max_latency_ms 0.585" in message
    assert f"the fastest within 0.0033 MB is about {fastest_within:.4f} ms/token" in message


@pytest.mark.fast
def test_the_size_only_plan_is_unchanged_by_a_latency_table():
    table = _sensitivity()
    assert at.choose(table, 3600, REST).schemes == at.choose(table, 3600, REST, latency=_latency()).schemes


def _profile_events(kernel_ms: list[list[tuple[str, float]]], call_ms: list[float], other_ms: float, execute: float):
    """A decode step's events as the tracer logs them: each delegate's kernels, then its DELEGATE_CALL; one op outside."""
    names, inside, ms = [], [], []
    for kernels, call in zip(kernel_ms, call_ms):
        for n, t in kernels:
            names.append(n), inside.append(True), ms.append(t)
        names.append("DELEGATE_CALL"), inside.append(False), ms.append(call)
    names += ["llama::custom_sdpa.out", "Method::execute"]
    inside += [False, False]
    ms += [other_ms, execute]
    return names, inside, ms


FC = "Fully Connected (NC, QDU8, F32, QB4W) GEMM #1"


@pytest.mark.fast
def test_a_delegate_calls_untraced_time_is_split_evenly_among_its_kernels():
    """Kernels too short for the tracer read 0: each gets its share of the call; a traced kernel keeps its own time
    plus its share; kernels that are not linear are not linear time; the step is Method::execute."""
    names, inside, ms = _profile_events(
        [[(FC, 0.0), (FC, 0.0), (FC, 0.0)], [("Add (ND) #1", 0.0), (FC, 0.002)], [(FC, 0.003)]],
        [0.006, 0.004, 0.004],
        0.01,
        0.05,
    )
    linear, total = lat.step_split(names, inside, ms)
    assert linear == pytest.approx([0.002, 0.002, 0.002, 0.003, 0.004])
    assert total == 0.05


UNITS = [
    {"name": "model.layers.0", "layers": ["q", "k"], "weight_bytes": {"fp": 800, "8da4w-pc": 100}},
    {"name": "lm_head", "layers": ["lm_head"], "weight_bytes": {"fp": 3200, "8da4w-pc": 400}},
]


@pytest.mark.fast
def test_apportioning_gives_each_unit_its_kernels_share_and_predicts_the_uniform_programs():
    """Two variants timed at 1.0 and 0.7 ms/token whose profiles put 40% / 16% of the step in the linear kernels:
    the rest is 0.6 and 0.588 ms (base: their median); each unit's cost is its kernels' share of the variant's time
    above the base; the uniform programs are predicted at what was measured."""
    measured = {"fp": {"median": 1.0, "min": 0.9, "max": 1.1}, "8da4w-pc": {"median": 0.7, "min": 0.6, "max": 0.8}}
    profiles = {
        "fp": {"linear_ms": [0.01, 0.01, 0.02], "total_ms": 0.1},  # q, k, lm_head
        "8da4w-pc": {"linear_ms": [0.002, 0.002, 0.004], "total_ms": 0.05},
    }
    table = lat.apportion(measured, profiles, UNITS)
    assert table["base_ms"] == pytest.approx((0.6 + 0.7 * 0.84) / 2)
    fp_linear = 1.0 - table["base_ms"]
    by = {u["name"]: u["ms"] for u in table["units"]}
    assert by["model.layers.0"]["fp"] == pytest.approx(fp_linear * 0.5)
    assert by["lm_head"]["fp"] == pytest.approx(fp_linear * 0.5)
    assert by["lm_head"]["8da4w-pc"] == pytest.approx((0.7 - table["base_ms"]) * 0.5)
    for scheme, t in measured.items():
        assert lat.predict(table, {u["name"]: scheme for u in UNITS}) == pytest.approx(t["median"])
    assert table["variants"]["fp"]["share_source"] == "etdump"
    mixed = lat.predict(table, {"model.layers.0": "8da4w-pc", "lm_head": "fp"})
    assert 0.7 < mixed < 1.0


@pytest.mark.fast
def test_kernels_that_do_not_map_onto_the_layers_split_the_linear_time_by_bytes():
    measured = {"fp": {"median": 1.0, "min": 1.0, "max": 1.0}}
    profiles = {"fp": {"linear_ms": [0.05, 0.05], "total_ms": 0.1}}  # 2 kernels for 3 layers
    table = lat.apportion(measured, profiles, UNITS)
    assert table["variants"]["fp"]["share_source"] == "bytes"
    by = {u["name"]: u["ms"]["fp"] for u in table["units"]}
    assert by["lm_head"] == pytest.approx(4 * by["model.layers.0"])


@pytest.mark.fast
@pytest.mark.parametrize("value", [0, -1.5, "big", float("inf"), True])
def test_bad_latency_budgets(value):
    with pytest.raises(UserError, match="--max_latency_ms must be a positive number"):
        at.check_budget(None, value)
    with pytest.raises(UserError, match="--max_latency_ms must be a positive number"):
        at.check_budget(2.0, value)
    assert at.check_budget(None, 0.3) is None and at.check_budget(2.0, 0.3) == 2_000_000


@pytest.mark.parametrize("extra", [["--max_latency_ms", "0"], ["--max_size_mb", "2", "--max_latency_ms=-1"]])
def test_the_cli_refuses_a_bad_latency_budget_before_torch_loads(tmp_path, tiny_llama, corpus, extra):
    cfg = write_config(tmp_path / "run.yaml", tiny_llama, corpus, tmp_path / "run", model={"mode": "ptq"})
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "qharness", "autotune", "--config", str(cfg), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(errors) == 1 and errors[0].startswith("error: --max_latency_ms must be a positive number"), errors
    assert "Traceback" not in result.stderr
    assert not re.search(r"\|\s+(torch|lightning|transformers|executorch)(\.|$)", result.stderr, re.M)


@pytest.mark.slow
def test_autotune_under_a_latency_budget_builds_times_and_checks_the_program(tmp_path, tiny_llama, corpus):
    """End to end on the tiny Llama (one rule per block): the variants built and timed (latency.json), a budget
    halfway between the all-4-bit and all-8-bit programs gives a plan predicted within it, whose .pte is timed."""
    cfg = write_config(
        tmp_path / "run.yaml",
        tiny_llama,
        corpus,
        tmp_path / "run",
        model={"recipe": "xnnpack_8da4w", "mode": "ptq"},
        bench={"enabled": False, "reps": 2, "prompt_len": 16, "decode_tokens": 16},
    )
    first = run_cli("autotune", cfg, "--max_latency_ms", "1e-6", "--unit", "block")
    assert first.returncode == 2 and "is below the fastest program these candidates allow" in first.stderr
    table = json.loads((tmp_path / "run" / "latency.json").read_text())
    slow, fast = (table["variants"][s]["decode_ms_per_token"]["median"] for s in ("8da8w-pc", "8da4w-pc"))
    budget = (slow + fast) / 2 if slow > fast else slow * 1.01
    r = run_cli("autotune", cfg, "--max_latency_ms", f"{budget:.6f}", "--unit", "block")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "latency.json: reused" in r.stdout and "[autotune] decode latency: predicted" in r.stdout
    record = json.loads((tmp_path / "run" / "autotune.json").read_text())
    assert record["predicted_ms_per_token"] <= budget and record["measured_ms_per_token"]["median"] > 0
    assert record["latency_verdict"] in ("MET", "NOT MET", "TIE/UNDECIDED")
    assert record["measured_cpu_ms_per_token"]["median"] > 0 and 0 < record["latency_cpu_share"]["median"] <= 1.5
    assert all(v["cpu_ms_per_token"]["median"] > 0 for v in table["variants"].values())
