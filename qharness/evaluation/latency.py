"""Per-layer decode latency of each candidate scheme, measured on real ``.pte`` programs ("by variants"), for
``qharness autotune --max_latency_ms``.

- **Variants**: one whole program per scheme, every unit at that scheme (all-fp, all-8da8w-pc, all-8da4w-pc, ...),
  timed in one joint interleaved benchmark (``runtime/joint.py``: fresh processes, alternating rounds): ``T[S]``, the
  median decode ms/token of the program all at ``S``, with its spread.
- **Shares**: each variant's ETDump profile (``runtime/profile.py``), one decode step: the XNNPACK ``Fully Connected``
  kernels in the order they ran, each with its share of its delegate call (``step_split``), mapped to the units'
  layers in forward order (one kernel per linear); what is not a linear kernel is the rest (attention, cache
  update, norms, embedding, the runtime's own work). When the kernels do not
  map one to one onto the layers, the linear time is split by the layers' weight bytes instead (``share_source``).
- **Model**: ``ms(assignment) = base + sum_u cost[u][scheme_u]``. Variant ``S``'s rest is ``T[S]`` times its
  profile's non-linear share; ``base`` is the median of those over the variants; ``cost[u][S] = (T[S] - base) *``
  the unit's share of the variant's linear time. So every uniform program is predicted at its measured ``T[S]`` and
  the model's error shows on mixed programs (autotune times the chosen one).

Example::

    table = apportion(measured={"fp": 0.40, "8da4w-pc": 0.22}, profiles=..., units=[...])
    predict(table, {"model.layers.0.self_attn.q_proj": "8da4w-pc", ...})
"""

from __future__ import annotations

import math
import statistics

from qharness.errors import UserError

LATENCY_FILE = "latency.json"
SCHEMA_VERSION = 1
LINEAR_KERNEL = "Fully Connected"  # XNNPACK's linear kernels: "Fully Connected (NC, QDU8, F32, QB4W) GEMM #3", ...


def step_split(names: list[str], delegated: list[bool], ms: list[float]) -> tuple[list[float], float]:
    """One decode step of a profile (its events in the order they ran): the linear kernels' ms in that order, and
    the step's total traced ms (``Method::execute``, else the events outside a delegate).

    A delegate's kernels are logged just before its ``DELEGATE_CALL``; the call's time that its kernels' own traces
    do not hold (the call's overhead, and kernels too short for the tracer's clock, which read 0) is split evenly
    among its kernels, so a linear kernel's time is its share of its delegate call."""
    linear: list[float] = []
    group: list[tuple[str, float]] = []
    total, execute = 0.0, None
    for name, inside, t in zip(names, delegated, ms):
        if inside:
            group.append((name, t))
            continue
        if name == "DELEGATE_CALL" and group:
            extra = max(0.0, t - sum(k for _, k in group)) / len(group)
            linear += [k + extra for n, k in group if n.startswith(LINEAR_KERNEL)]
        group = []
        if name == "Method::execute":
            execute = t
        else:
            total += t
    total = execute if execute is not None else total
    return linear, max(total, sum(linear))


def shares(
    units: list[dict], scheme: str, linear_ms: list[float], total_ms: float
) -> tuple[dict[str, float], float, str]:
    """``({unit: share of the step}, linear share of the step, source)``: the kernels mapped to the units' layers in
    order when there is one per layer (``etdump``), else the linear time split by weight bytes (``bytes``)."""
    layers = [(u["name"], n) for u in units for n in u["layers"]]
    if total_ms <= 0:
        raise ValueError("a profile with no traced time")
    linear_share = sum(linear_ms) / total_ms
    out = {u["name"]: 0.0 for u in units}
    if len(linear_ms) == len(layers):
        for (unit, _), ms in zip(layers, linear_ms):
            out[unit] += ms / total_ms
        return out, linear_share, "etdump"
    nbytes = {u["name"]: u["weight_bytes"][scheme] for u in units}
    whole = sum(nbytes.values())
    return {u: linear_share * b / whole for u, b in nbytes.items()}, linear_share, "bytes"


def apportion(measured: dict[str, dict], profiles: dict[str, dict], units: list[dict]) -> dict:
    """The latency table from the variants' joint timings (``measured``: scheme -> ``decode_ms_per_token`` spread) and
    their decode-step profiles (``profiles``: scheme -> ``{"linear_ms": [...], "total_ms": x}``); ``units``: the
    sensitivity table's units (``name``, ``layers``, ``weight_bytes``). Returns ``{"base_ms", "variants", "units":
    [{"name", "layers", "ms": {scheme: ms}}]}``."""
    variants, rest = {}, []
    for scheme, t in measured.items():
        p = profiles[scheme]
        unit_share, linear_share, source = shares(units, scheme, p["linear_ms"], p["total_ms"])
        ms = t["median"]
        variants[scheme] = {
            "decode_ms_per_token": t,
            "linear_share": linear_share,
            "share_source": source,
            "unit_share": unit_share,
        }
        rest.append(ms * (1 - linear_share))
    base = statistics.median(rest)
    out_units = []
    for u in units:
        cost = {}
        for scheme, v in variants.items():
            linear = max(0.0, v["decode_ms_per_token"]["median"] - base)
            cost[scheme] = linear * v["unit_share"][u["name"]] / v["linear_share"] if v["linear_share"] > 0 else 0.0
        out_units.append({"name": u["name"], "layers": list(u["layers"]), "ms": cost})
    return {"schema_version": SCHEMA_VERSION, "base_ms": base, "variants": variants, "units": out_units}


def predict(table: dict, schemes: dict[str, str]) -> float:
    """Predicted decode ms/token of the program whose units have ``schemes`` (``{unit: scheme}``)."""
    by = {u["name"]: u["ms"] for u in table["units"]}
    return table["base_ms"] + sum(by[u][s] for u, s in schemes.items())


def fastest(table: dict, allowed: dict[str, list[str]]) -> tuple[float, dict[str, str]]:
    """The least predicted decode ms/token over ``allowed`` (``{unit: [schemes]}``) and the assignment that gives it."""
    by = {u["name"]: u["ms"] for u in table["units"]}
    pick = {u: min((s for s in ss if s in by[u]), key=lambda s: by[u][s]) for u, ss in allowed.items()}
    return predict(table, pick), pick


def check_latency_budget(max_latency_ms) -> float | None:
    """``--max_latency_ms`` (decode ms/token) as a float, None when absent; ``UserError`` unless a positive number."""
    if max_latency_ms is None:
        return None
    if (
        isinstance(max_latency_ms, bool)
        or not isinstance(max_latency_ms, (int, float))
        or not 0 < max_latency_ms < math.inf
    ):
        raise UserError(
            f"--max_latency_ms must be a positive number of decode ms per token (got {max_latency_ms!r})",
            fix="e.g. --max_latency_ms 0.3 (qharness bench --pte MODEL.pte shows a program's decode ms/token)",
        )
    return float(max_latency_ms)


def table_matches(table: dict, wanted: dict) -> str | None:
    """Why a cached ``latency.json`` cannot be reused (None: it can): its key fields differ from ``wanted``."""
    if table.get("schema_version") != SCHEMA_VERSION:
        return f"its schema_version is {table.get('schema_version')!r}"
    for key, value in wanted.items():
        if table.get(key) != value:
            return f"its {key} is {table.get(key)!r}, this run's {value!r}"
    return None


def format_table(table: dict) -> str:
    """The unit x scheme table of decode ms/token, then the variants' measured times and the base."""
    schemes = list(table["variants"])
    rows = [(table.get("unit", "unit"), *schemes)]
    rows += [(u["name"], *(f"{u['ms'][s]:.4f}" for s in schemes)) for u in table["units"]]
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["latency: decode ms/token per unit and scheme (apportioned from whole programs, see latency.json)"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in rows]
    for s, v in table["variants"].items():
        t = v["decode_ms_per_token"]
        lines.append(
            f"all {s}: measured {t['median']:.4f} ms/token ({t['min']:.4f}-{t['max']:.4f}), linear kernels "
            f"{v['linear_share']:.0%} of the traced step (shares: {v['share_source']})"
        )
    lines.append(f"rest of the program (attention, cache, norms, embedding, the call): {table['base_ms']:.4f} ms/token")
    return "\n".join(lines)
