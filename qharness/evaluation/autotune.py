"""Per-layer precision under a size budget (``qharness autotune CONFIG --max_size_mb X``): pick each layer's scheme
from a ``qharness sensitivity`` table so that the ``.pte`` fits the budget and the predicted perplexity cost is least,
then write the choice as a recipe (``autotuned.yaml``: ``base:`` and one ``layers:`` rule per unit) that the normal
calibrate/fit path runs, and that a user can read, edit and run again.

- **Cost** of a unit at a scheme: the log of its perplexity ratio against FP from ``sensitivity.json`` (``--against
  fp``: the unit quantized alone), so costs add up as if the units were independent (a first-order model; the run
  measures the real thing). ``fp`` costs 0. A scheme never costs less than one that stores more bytes for the same
  unit (isotonic in bytes): a lower figure there is noise, and trusting it would trade precision for nothing.
- **Size**: the ``.pte`` is predicted as the sum of the units' ``weight_bytes`` at their schemes (what XNNPACK
  stores: int4 values for 2/3/4-bit weights, int8 for 8-bit, fp32 for fp, plus scales) plus the rest of the program
  (``rest_bytes``: the embedding and every other non-linear tensor at the bytes it is stored in, and a fixed program
  overhead). The run reports predicted against measured size.
- **Choice**: an exact multiple-choice knapsack (dynamic programme over byte costs rounded up to ``resolution``
  bytes, so a chosen plan never exceeds the budget by rounding) minimising the summed cost; equal costs go to the
  smaller ``.pte``.

Example::

    plan = choose(json.load(open("runs/x/sensitivity.json")), budget_bytes=1_600_000, rest_bytes=1_200_000)
    write_recipe(plan, Path("runs/x/autotuned.yaml"), base="xnnpack_8da4w", command="qharness autotune ...")
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from qharness.errors import UserError
from qharness.evaluation.sensitivity import OVERHEAD_PER_LAYER_BYTES, without_note
from qharness.recipes.layers import FP  # the scheme of a layer kept in floating point

RECIPE_FILE = "autotuned.yaml"
PLAN_FILE = "autotune.json"
# Program bytes besides the tensors: a fixed 4 KB, and OVERHEAD_PER_LAYER_BYTES per linear (sensitivity.py); a
# recipe with split_head_input adds the split's graph (recipes/split_input.py), 4,224 bytes: xnnpack_8da4w_zp_split's
# program over xnnpack_8da4w_zp's of the same weights, on SmolLM2-135M and on a 1-layer test Llama alike
OVERHEAD_BYTES, SPLIT_HEAD_BYTES = 4096, 4224


@dataclass
class Plan:
    """A per-unit assignment: ``schemes`` ``{unit: scheme}``, each unit's ``layers`` (module names), the predicted
    ``.pte`` bytes and perplexity ratio against FP (the product of the units' ratios), the budgets (None: not set),
    and the predicted decode ms/token (with a latency table)."""

    schemes: dict[str, str]
    layers: dict[str, list[str]]
    unit: str
    predicted_bytes: int
    predicted_ppl_ratio: float
    budget_bytes: int | None
    rest_bytes: int
    baseline_ppl: float
    rules: list[dict] = field(default_factory=list)
    max_latency_ms: float | None = None
    predicted_ms: float | None = None

    @property
    def predicted_ppl(self) -> float:
        return self.baseline_ppl * self.predicted_ppl_ratio

    def to_dict(self) -> dict:
        return {
            "unit": self.unit,
            "schemes": self.schemes,
            "predicted_size_bytes": self.predicted_bytes,
            "predicted_ppl": self.predicted_ppl,
            "predicted_ppl_ratio_vs_fp": self.predicted_ppl_ratio,
            "budget_bytes": self.budget_bytes,
            "rest_bytes": self.rest_bytes,
            "fp_ppl": self.baseline_ppl,
            "rules": self.rules,
            "max_latency_ms": self.max_latency_ms,
            "predicted_ms_per_token": self.predicted_ms,
        }

    def budgets(self) -> str:
        """The budgets in words: ``.pte <= 2 MB, decode <= 0.3 ms/token``."""
        out = [] if self.budget_bytes is None else [f".pte <= {self.budget_bytes / 1e6:g} MB"]
        return ", ".join(out + ([] if self.max_latency_ms is None else [f"decode <= {self.max_latency_ms:g} ms/token"]))


def options(unit: dict) -> dict[str, tuple[int, float]]:
    """``{scheme: (bytes, cost)}`` of one ``sensitivity.json`` unit: its applicable candidates and fp (cost 0), each
    cost the log perplexity ratio made isotonic (never below that of a scheme storing more bytes of its own: a tied
    head's values kept once with its table, ``share_tables``, still count for its precision)."""
    raw = {FP: (unit["weight_bytes"][FP], 0.0)} if FP in unit["weight_bytes"] else {}
    for c, r in unit["results"].items():
        if c != FP and r.get("applicable", True) and r.get("ppl_ratio"):
            raw[c] = (unit["weight_bytes"][c], math.log(r["ppl_ratio"]))
    shared = unit.get("shared_bytes", {})
    out, floor = {}, 0.0
    for c, (b, cost) in sorted(raw.items(), key=lambda kv: -(kv[1][0] + shared.get(kv[0], 0))):  # most bytes first
        floor = max(floor, cost)
        out[c] = (b, floor)
    return out


def check_budget(max_size_mb, max_latency_ms=None) -> int | None:
    """``--max_size_mb`` as bytes (None when absent and ``--max_latency_ms`` is given; ``UserError`` when neither is
    given or either is not a positive number), before any model loads."""
    from qharness.evaluation.latency import check_latency_budget

    if max_size_mb is None and check_latency_budget(max_latency_ms) is not None:
        return None
    if max_size_mb is None:
        raise UserError(
            "autotune needs a budget: --max_size_mb (the .pte in MB) and/or --max_latency_ms (decode ms/token)",
            fix="e.g. --max_size_mb 2.0",
        )
    if isinstance(max_size_mb, bool) or not isinstance(max_size_mb, (int, float)) or not 0 < max_size_mb < math.inf:
        raise UserError(f"--max_size_mb must be a positive number of MB (got {max_size_mb!r})", fix="e.g. 2.0")
    check_latency_budget(max_latency_ms)
    return int(max_size_mb * 1e6)


def check_fits(table: dict, budget_bytes: int, rest_bytes: int) -> None:
    """``UserError`` saying the smallest possible ``.pte`` when nothing the candidates allow fits the budget."""
    least, pick = smallest_bytes(table, rest_bytes)
    if least > budget_bytes:
        schemes = sorted(set(pick.values()))
        raise UserError(
            f"--max_size_mb {budget_bytes / 1e6:g} is below the smallest .pte these candidates allow, about "
            f"{least / 1e6:.3f} MB ({rest_bytes / 1e6:.3f} MB embedding and program, the layers at {', '.join(schemes)})",
            fix=f"use --max_size_mb {math.ceil(least / 1e4) / 100:.2f} or more, or add smaller candidates "
            "(e.g. --candidates 8da8w-pc,8da4w-pc,8da4w-g128) or embedding_bits in the recipe",
        )


def check_not_all_fp(plan: Plan) -> None:
    if all(s == FP for s in plan.schemes.values()):
        fast = "" if plan.predicted_ms is None else f", {plan.predicted_ms:.4f} ms/token"
        raise UserError(
            f"the budget ({plan.budgets()}) holds the whole FP model ({plan.predicted_bytes / 1e6:.3f} MB{fast} "
            "predicted): there is nothing to tune",
            fix="use the FP recipe (xnnpack_fp32), or a smaller budget",
        )


def check_table(table: dict, where: str) -> None:
    """The sensitivity table must be one measured against FP, with fp bytes per unit (``UserError`` otherwise)."""
    if table.get("against") != "fp":
        raise UserError(
            f"{where} was measured --against {table.get('against')}; autotune needs the cost of each unit against FP",
            fix="measure it with qharness sensitivity CONFIG --against fp (or let autotune measure it)",
        )
    if not table.get("units") or any(FP not in u.get("weight_bytes", {}) for u in table["units"]):
        raise UserError(
            f"{where} has no fp weight_bytes per unit (written by an older qharness)",
            fix="measure it again: qharness sensitivity CONFIG",
        )


def smallest_bytes(table: dict, rest_bytes: int) -> tuple[int, dict[str, str]]:
    """The smallest ``.pte`` the table's candidates allow, and the assignment that gives it."""
    pick = {u["name"]: min(options(u).items(), key=lambda kv: (kv[1][0], kv[1][1]))[0] for u in table["units"]}
    by = {u["name"]: u for u in table["units"]}
    return rest_bytes + sum(by[n]["weight_bytes"][s] for n, s in pick.items()), pick


def choose(
    table: dict,
    budget_bytes: int | None,
    rest_bytes: int,
    resolution: int | None = None,
    latency: dict | None = None,
    max_latency_ms: float | None = None,
) -> Plan:
    """The assignment of least summed cost whose predicted ``.pte`` bytes fit ``budget_bytes`` and (with ``latency``,
    ``evaluation/latency.py``'s table) whose predicted decode ms/token fits ``max_latency_ms``; either budget may be
    None. An exact knapsack over costs rounded up to ``resolution`` bytes (default room/4096, room/1024 under both
    budgets) and to 1/1024 (both) or 1/4096 of the latency room, so a chosen plan never exceeds a budget by rounding;
    ``UserError`` when no assignment fits (naming the smallest, or the fastest, achievable)."""
    check_table(table, "the sensitivity table")
    units = table["units"]
    if budget_bytes is not None:
        check_fits(table, budget_bytes, rest_bytes)
    if max_latency_ms is not None:
        check_fast_enough(table, latency, max_latency_ms)
    opts = [list(unit_options(u, latency if max_latency_ms is not None else None).items()) for u in units]
    picks = _knapsack(opts, budget_bytes, rest_bytes, resolution, latency, max_latency_ms, key=1)
    if picks is None and max_latency_ms is not None and budget_bytes is not None:
        fast = _knapsack(opts, budget_bytes, rest_bytes, None, None, None, key=2)
        best = _predicted_ms(latency, units, fast) if fast else None
        raise UserError(
            f"no assignment fits both --max_size_mb {budget_bytes / 1e6:g} and --max_latency_ms {max_latency_ms:g}: "
            + (f"the fastest within {budget_bytes / 1e6:g} MB is about {best:.4f} ms/token predicted" if best else ""),
            fix=f"use --max_latency_ms {math.ceil(best * 1e4) / 1e4:.4f} or more, or a larger --max_size_mb"
            if best
            else "a larger --max_size_mb",
        )
    if picks is None:  # rounding took the last room: the exact smallest (or fastest) still fits, take it
        _, pick = smallest_bytes(table, rest_bytes) if max_latency_ms is None else fastest_pick(table, latency)
        picks = [pick[u["name"]] for u in units]
    schemes = {u["name"]: s for u, s in zip(units, picks)}
    nbytes = sum(u["weight_bytes"][s] for u, s in zip(units, picks))
    ratio = math.exp(sum(options(u)[s][1] for u, s in zip(units, picks)))
    plan = Plan(
        schemes=schemes,
        layers={u["name"]: list(u["layers"]) for u in units},
        unit=table["unit"],
        predicted_bytes=int(rest_bytes + nbytes),
        predicted_ppl_ratio=ratio,
        budget_bytes=None if budget_bytes is None else int(budget_bytes),
        rest_bytes=int(rest_bytes),
        baseline_ppl=table["baseline"]["ppl"],
        max_latency_ms=max_latency_ms,
        predicted_ms=_predicted_ms(latency, units, picks) if latency else None,
    )
    plan.rules = rules(plan, table["candidates"])
    return plan


def unit_options(unit: dict, latency: dict | None) -> dict[str, tuple[int, float, float]]:
    """``{scheme: (bytes, cost, ms)}`` of one unit: ``options`` with each scheme's decode ms/token from the latency
    table (0 without one; under a latency budget a scheme the table did not time is left out)."""
    if latency is None:
        return {s: (b, c, 0.0) for s, (b, c) in options(unit).items()}
    ms = {u["name"]: u["ms"] for u in latency["units"]}.get(unit["name"], {})
    return {s: (b, c, ms[s]) for s, (b, c) in options(unit).items() if s in ms}


def _predicted_ms(latency: dict, units: list[dict], picks) -> float:
    from qharness.evaluation.latency import predict

    return predict(latency, {u["name"]: s for u, s in zip(units, picks)})


def fastest_pick(table: dict, latency: dict) -> tuple[float, dict[str, str]]:
    """The least predicted decode ms/token these candidates allow, and the assignment that gives it."""
    from qharness.evaluation.latency import fastest

    allowed = {u["name"]: list(unit_options(u, latency)) for u in table["units"]}
    if any(not s for s in allowed.values()):
        missing = [n for n, s in allowed.items() if not s]
        raise UserError(
            f"the latency table has no timing for {missing[0]}'s schemes",
            fix="delete latency.json in the run directory and run autotune again (it measures it)",
        )
    return fastest(latency, allowed)


def check_fast_enough(table: dict, latency: dict | None, max_latency_ms: float) -> None:
    """``UserError`` naming the fastest achievable decode ms/token when even it is over ``max_latency_ms``."""
    if latency is None:
        raise ValueError("a latency budget needs the latency table")
    least, pick = fastest_pick(table, latency)
    if least > max_latency_ms:
        schemes = sorted(set(pick.values()))
        raise UserError(
            f"--max_latency_ms {max_latency_ms:g} is below the fastest program these candidates allow, about "
            f"{least:.4f} ms/token predicted ({latency['base_ms']:.4f} ms outside the tuned layers, the layers at "
            f"{', '.join(schemes)})",
            fix=f"use --max_latency_ms {math.ceil(least * 1e4) / 1e4:.4f} or more",
        )


def _knapsack(opts, budget_bytes, rest_bytes, resolution, latency, max_latency_ms, key: int):
    """The schemes (one per unit) of least summed ``key`` (1: perplexity cost, 2: ms; ties: fewer bytes) whose
    rounded-up bytes and ms fit the budgets (None: that budget is not set); None when nothing fits the grid.

    A dynamic programme over a grid of (byte steps x ms steps): ``best[b, l]`` is the least (key, bytes) of the
    units so far within ``b`` byte steps and ``l`` ms steps; each unit's choice per cell is kept to trace back."""
    import numpy as np

    both = budget_bytes is not None and max_latency_ms is not None
    if budget_bytes is not None:
        room = budget_bytes - rest_bytes
        step_b = resolution or max(1, room // (1024 if both else 4096))
        cap_b = room // step_b
    else:
        step_b, cap_b = 1, 0
    if max_latency_ms is not None:
        room_ms = max_latency_ms - latency["base_ms"]
        cap_l = 1024 if both else 4096
        step_l = max(room_ms, 1e-12) / cap_l
    else:
        step_l, cap_l = 1.0, 0
    shape = (cap_b + 1, cap_l + 1)
    best_key = np.zeros(shape)
    best_bytes = np.zeros(shape)
    choices = []
    for unit_opts in opts:
        new_key = np.full(shape, np.inf)
        new_bytes = np.full(shape, np.inf)
        choice = np.full(shape, -1, dtype=np.int16)
        for i, (_, o) in enumerate(unit_opts):
            nbytes, value = o[0], o[key]
            wb = -(-nbytes // step_b) if budget_bytes is not None else 0  # rounded up: never over the budget
            wl = math.ceil(o[2] / step_l - 1e-9) if max_latency_ms is not None else 0
            if wb > cap_b or wl > cap_l:
                continue
            cand_key = np.round(best_key[: shape[0] - wb, : shape[1] - wl] + value, 12)
            cand_bytes = best_bytes[: shape[0] - wb, : shape[1] - wl] + nbytes
            cur_key, cur_bytes = new_key[wb:, wl:], new_bytes[wb:, wl:]
            better = (cand_key < cur_key) | ((cand_key == cur_key) & (cand_bytes < cur_bytes))
            cur_key[better] = cand_key[better]
            cur_bytes[better] = cand_bytes[better]
            choice[wb:, wl:][better] = i
        best_key, best_bytes = new_key, new_bytes
        choices.append(choice)
    if best_key[-1, -1] == np.inf:
        return None
    b, lat, picks = cap_b, cap_l, []
    for unit_opts, choice in zip(reversed(opts), reversed(choices)):
        i = int(choice[b, lat])
        scheme, o = unit_opts[i]
        picks.append(scheme)
        b -= -(-o[0] // step_b) if budget_bytes is not None else 0
        lat -= math.ceil(o[2] / step_l - 1e-9) if max_latency_ms is not None else 0
    return picks[::-1]


def rules(plan: Plan, candidates: dict[str, dict]) -> list[dict]:
    """One ``layers:`` rule per unit: its module name (a layer) or ``<block>.*`` (a decoder block's linears)."""
    out = []
    for name, scheme in plan.schemes.items():
        layers = plan.layers[name]
        match = name if layers == [name] else f"{name}.*"
        out.append({"match": match, **(candidates.get(scheme) or {"quant": FP})})
    return out


def rest_bytes(model, table: dict, max_seq_len: int, recipe=None) -> int:
    """Predicted bytes of the ``.pte`` outside the table's units: every parameter and persistent buffer of modules
    that are not units' layers (fp32; an embedding table as ``recipe`` quantizes it, ``Recipe.table_quant``, when
    given), the rotary cos/sin tables of ``max_seq_len`` positions the static-cache export bakes in, and the program
    overhead (with the split head input's graph when ``recipe`` has it)."""
    import torch

    from qharness.sources.models import tied_tables

    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary = any(n.endswith("rotary_emb") for n, _ in model.named_modules())
    n_layers = sum(len(u["layers"]) for u in table["units"])

    taken = {n for u in table["units"] for n in u["layers"]}
    tied = tied_tables(model)
    seen, total = set(), 0
    for name, module in model.named_modules():
        # a tied table is counted here; a head that keeps its values once with it costs its scales (share_tables)
        if name in taken:
            continue
        tensors = list(module.parameters(recurse=False)) + [
            b for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set
        ]
        quant = recipe.table_quant(name in tied) if recipe and isinstance(module, torch.nn.Embedding) else None
        for t in tensors:
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            if quant is not None:
                total += quant.stored_bytes(*t.shape)
            else:
                total += t.numel() * t.element_size()
    total += 2 * max_seq_len * head_dim * 4 if rotary else 0
    split = SPLIT_HEAD_BYTES if getattr(getattr(recipe, "settings", None), "split_head_input", False) else 0
    return total + OVERHEAD_BYTES + OVERHEAD_PER_LAYER_BYTES * n_layers + split


def share_tables(table: dict, shared: dict[str, dict[str, int]]) -> dict:
    """``table`` with each tied output projection's bytes less what it keeps once with its lookup table
    (``sensitivity.shared_table_bytes``: ``{layer: {scheme: bytes}}``): the unit holding that layer costs only its
    scales at such a scheme, since ``rest_bytes`` counts the table. The units' ``shared_bytes`` say by how much."""
    units = []
    for u in table["units"]:
        cut = {}
        for layer in u["layers"]:
            for scheme, n in shared.get(layer, {}).items():
                cut[scheme] = cut.get(scheme, 0) + n
        if cut:
            u = {**u, "weight_bytes": {s: b - cut.get(s, 0) for s, b in u["weight_bytes"].items()}, "shared_bytes": cut}
        units.append(u)
    return {**table, "units": units}


def format_plan(plan: Plan, table: dict, latency: dict | None = None) -> str:
    """The chosen scheme per unit with its bytes, predicted cost (and decode ms/token), then the predicted totals."""
    by = {u["name"]: u for u in table["units"]}
    ms = {u["name"]: u["ms"] for u in latency["units"]} if latency else None
    rows = [(table["unit"], "scheme", "weight bytes", "ppl vs FP (sensitivity)", *(["decode ms/token"] if ms else []))]
    for name, scheme in plan.schemes.items():
        r = by[name]["results"].get(scheme)
        cost = "0 (fp)" if scheme == FP else f"{r['ppl_ratio'] - 1:+.2%}"
        shared = by[name].get("shared_bytes", {}).get(scheme)
        nbytes = f"{by[name]['weight_bytes'][scheme]:,}" + (
            "" if shared is None else f" (+{shared:,} kept once with the tied table)"
        )
        row = (name, scheme, nbytes, cost)
        rows.append((*row, f"{ms[name][scheme]:.4f}") if ms else row)
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    counts: dict[str, int] = {}
    for s in plan.schemes.values():
        counts[s] = counts.get(s, 0) + 1
    return "\n".join(
        ["  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in rows]
        + [
            f"assignment: {', '.join(f'{n} x {s}' for s, n in sorted(counts.items()))}",
            f"predicted .pte {plan.predicted_bytes / 1e6:.3f} MB ("
            + ("" if plan.budget_bytes is None else f"budget {plan.budget_bytes / 1e6:g} MB; ")
            + f"{plan.rest_bytes / 1e6:.3f} MB of it outside the tuned layers), predicted ppl {plan.predicted_ppl:.3f} "
            f"({plan.predicted_ppl_ratio - 1:+.2%} vs FP {plan.baseline_ppl:.3f}, summing the units' measured costs"
            f"{without_note(table)})",
        ]
        + (
            []
            if plan.predicted_ms is None
            else [
                f"predicted decode {plan.predicted_ms:.4f} ms/token"
                + ("" if plan.max_latency_ms is None else f" (budget {plan.max_latency_ms:g} ms/token)")
                + f"; {latency['base_ms']:.4f} of it outside the tuned layers"
            ]
        )
    )


def write_recipe(plan: Plan, path: Path, base: str, command: str) -> Path:
    """``autotuned.yaml``: a recipe on ``base`` with one ``layers:`` rule per unit, headed by the command that made it,
    the budget and the prediction (``qharness calibrate CONFIG --model.recipe PATH`` runs it again)."""
    import yaml

    from qharness.io.atomic import write_bytes_atomic

    head = [
        f"# written by: {command}",
        f"# budget: {plan.budgets()}; predicted .pte {plan.predicted_bytes:,} bytes, predicted "
        f"ppl {plan.predicted_ppl:.3f} ({plan.predicted_ppl_ratio - 1:+.2%} vs FP)"
        + ("" if plan.predicted_ms is None else f", predicted decode {plan.predicted_ms:.4f} ms/token"),
        f"# one rule per {plan.unit} (first match wins); edit and run again: qharness calibrate CONFIG --model.recipe {path}",
    ]
    body = {
        "base": base,
        "description": f"autotuned per-{plan.unit} precision for {plan.budgets()} (base {Path(base).stem})",
    }
    text = yaml.safe_dump(body, sort_keys=False) + "layers:\n"
    for r in plan.rules:
        text += "  - " + yaml.safe_dump(r, default_flow_style=True, sort_keys=False).strip() + "\n"
    return write_bytes_atomic(path, ("\n".join(head) + "\n" + text).encode())


def table_matches(
    table: dict,
    model: str,
    eval_blocks: int,
    seq_len: int,
    val_blocks: str,
    unit: str,
    recipe: str | None = None,
    candidates: list[str] = (),
) -> str | None:
    """Why an existing ``sensitivity.json`` cannot be reused for this config (None: it can): another model, blocks,
    unit, scheme ``recipe`` (whose settings made the candidates), or no column for one of ``candidates``."""
    wanted = {
        "model": model,
        "eval_blocks": eval_blocks,
        "seq_len": seq_len,
        "val_blocks": val_blocks,
        "unit": unit,
        "against": "fp",
    }
    if recipe is not None:
        wanted["recipe"] = recipe
    for key, value in wanted.items():
        if table.get(key) != value:
            return f"its {key} is {table.get(key)!r}, this config's {value!r}"
    if any(FP not in u.get("weight_bytes", {}) for u in table.get("units", [])):
        return "it has no fp weight_bytes (older qharness)"
    missing = [c for c in candidates if c not in table.get("candidates", {})]
    return f"it has no column for {', '.join(missing)}" if missing else None


def only_candidates(table: dict, candidates: list[str]) -> dict:
    """``table`` with the columns of ``candidates`` alone (a reused table may hold more than this run asks for)."""
    keep = [c for c in table["candidates"] if c in candidates]
    return {
        **table,
        "candidates": {c: table["candidates"][c] for c in keep},
        "units": [{**u, "results": {c: r for c, r in u["results"].items() if c in keep}} for u in table["units"]],
    }
