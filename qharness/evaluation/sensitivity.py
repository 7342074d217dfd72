"""Per-layer quantization sensitivity (``qharness sensitivity CONFIG``): the held-out perplexity cost of each layer
(or decoder block) at each candidate precision, measured with the converted (really quantized) model, with a noise band.

Two baselines (``against``):

- ``fp``: the FP model; each unit is quantized alone at each candidate (the cost of quantizing it).
- ``recipe``: the recipe's own quantized model (its ``layers:`` rules included); each unit is set to each candidate,
  ``fp`` included (the cost, or gain, of changing it alone; ``fp`` = leaving it alone in floating point).

Every figure is paired against the baseline on the same validation blocks (``checks/stats.py``: the interval of the
per-block loss differences), so the band is the noise of the comparison itself. Candidates are scheme names of the
``torchao_8da4w`` quantizer (``recipes/torchao.py``, ``scheme_name``): ``fp``, ``8da8w-pc``, ``8da4w-pc``,
``8da4w-g32``, ...; each maps to the rule a recipe's ``layers:`` takes (``candidates`` in the JSON), so a tool that
picks a per-layer assignment from ``sensitivity.json`` writes its rules straight from it. Each unit also carries an
estimate of its weight bytes in the ``.pte`` per candidate and for ``fp`` (``weight_bytes``: int8/int4 values, fp32
per-channel or bf16 group scales, fp32 bias; as XNNPACK stores them), which ``qharness autotune`` (``autotune.py``)
adds up under a size budget.

Example::

    result = measure(fp_model, recipe, x, y, batch_size=8, candidates=default_candidates(recipe))
    print(format_table(result)); write_outputs(result, Path("runs/ptq_xnnpack"))
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import time
from pathlib import Path

from qharness.errors import UserError
from qharness.recipes.layers import FP  # the scheme of a layer kept in floating point

UNITS = ("layer", "block")
AGAINST = ("fp", "recipe")
SCHEMA_VERSION = 1
_SCHEME = re.compile(r"8da([2348])w-(pc|g(\d+))")
# settings that choose the deployed weights on calibration blocks, and their plain values (a unit's copy has none);
# zero points need no data (min-max per group): a unit holding zero-point layers is measured with them
CHOSEN_ON_DATA = {"learn_scales": False, "rounding": "nearest", "smoothing": None}
# Program bytes a linear's GEMM adds besides its tensors (flatbuffer, delegate headers, per-op metadata), fitted to two
# measured XNNPACK .pte files (docs/benchmarks/tools.md, autotune): 45.8 KB over 15 linears (tiny test Llama), 84.6 KB
# over 29; since a decoder layer lowers as a few partitions, not one per linear (deploy/whole_layers.py), the tiny
# test Llama's program is 36.9 KB over its tensors: 2,184 bytes per linear above a fixed 4 KB. A zero-point layer's
# second GEMM adds as much (SmolLM2's 120 of them: 262 KB; without them the uniform zp_split program was 250 KB, 0.27%,
# over the prediction).
OVERHEAD_PER_LAYER_BYTES = 2184
_BLOCK = re.compile(r"^(.*\.layers\.\d+)\.")  # decoder block of a module name (HF: model.layers.N.)


def candidate_rule(name: str) -> dict:
    """The ``layers:`` rule settings of a candidate scheme name (``8da4w-g32`` -> weight_bits 4, group_size 32)."""
    if name == FP:
        return {"quant": FP}
    m = _SCHEME.fullmatch(name)
    if m is None:
        raise UserError(
            f"--candidates: unknown scheme {name!r}",
            fix="use fp, 8da8w-pc, 8da4w-pc, 8da4w-g<N>, or 2/3 bits (8da3w-g32, ...) (int8 dynamic activations; pc: per "
            "channel, gN: groups of N)",
        )
    return {"weight_bits": int(m.group(1)), "group_size": None if m.group(2) == "pc" else int(m.group(3))}


def default_candidates(recipe, against: str = "fp") -> list[str]:
    """What XNNPACK lowers: int8 and int4 per channel, int4 in the recipe's groups (default 32), and fp unless fp is
    the baseline."""
    group = getattr(recipe.settings, "group_size", None) or 32
    return ([] if against == "fp" else [FP]) + ["8da8w-pc", "8da4w-pc", f"8da4w-g{group}"]


def scheme_recipe(recipe, against: str):
    """The recipe whose quantizer makes the candidates: ``recipe`` when it is source-level (torchao), else (baseline
    ``fp`` only) the built-in ``xnnpack_8da4w``, so that a run config of any XNNPACK recipe can be measured."""
    if recipe.kind == "source":
        return recipe
    if against == "recipe":
        raise UserError(
            f"--against recipe needs a source-level recipe (torchao_8da4w); {recipe.name!r} is {recipe.kind}",
            fix="--model.recipe xnnpack_8da4w (or a recipe based on it), or --against fp",
        )
    from qharness.recipes.registry import load_recipe

    return load_recipe("xnnpack_8da4w")


def check_options(recipe, candidates: str | None, unit: str, against: str) -> list[str]:
    """The candidate names (``--candidates a,b``, else ``default_candidates``), checked with the unit and baseline
    before any model loads; ``UserError`` naming the option otherwise."""
    if unit not in UNITS:
        raise UserError(f"--unit must be one of {', '.join(UNITS)} (got {unit!r})", fix="--unit layer")
    if against not in AGAINST:
        raise UserError(f"--against must be one of {', '.join(AGAINST)} (got {against!r})", fix="--against fp")
    recipe = scheme_recipe(recipe, against)
    names = (
        [c.strip() for c in candidates.split(",") if c.strip()] if candidates else default_candidates(recipe, against)
    )
    if len(set(names)) != len(names) or not names:
        raise UserError(
            f"--candidates must name distinct schemes (got {candidates!r})", fix="--candidates fp,8da4w-g32"
        )
    for name in names:
        _settings(recipe, name)
    return names


def _settings(recipe, name: str, zero_points: bool = False):
    """The quantizer settings of candidate ``name`` (None for fp): the recipe's, with the candidate's bits and group,
    min-max scales and nearest rounding: what chooses the weights on calibration blocks (``rounding``, ``smoothing``,
    ``learn_scales``) works on a whole model in the run, not on a unit's copy here. ``zero_points``: with the recipe's
    zero-point globs (for ``_zero_point_copies``; else none)."""
    rule = candidate_rule(name)
    if rule.get("quant") == FP:
        return None
    from qharness.recipes.registration import parse_settings

    own = dataclasses.asdict(recipe.settings)
    tables = {k: None for k in ("embedding_bits", "untied_embedding_bits") if k in own}  # a unit's layers only
    chosen = {k: v for k, v in CHOSEN_ON_DATA.items() if k in own}
    if "zero_points" in own and not zero_points:
        chosen["zero_points"] = None
    merged = {**own, **rule, **tables, **chosen}
    try:
        return parse_settings(type(recipe.settings), merged, f"--candidates {name}")
    except UserError as e:  # the settings' own range checks: name the option
        raise UserError(f"--candidates {name}: {e.what}", fix=e.fix) from None


def _quantizer(recipe, name: str, zero_points: bool = False):
    """The (PTQ) quantizer of candidate ``name`` built from ``_settings`` (None for fp)."""
    from qharness.recipes.registration import QUANTIZERS

    settings = _settings(recipe, name, zero_points)
    return None if settings is None else QUANTIZERS[recipe.quantizer].build(settings, False)


def measured_without(recipe) -> list[str]:
    """The recipe's settings that ``_settings`` leaves out of the candidates (``CHOSEN_ON_DATA``), as ``setting:
    value`` (a list or flag by its name): the table's costs are those of min-max, nearest-rounded weights, not of
    what those settings choose."""
    own = dataclasses.asdict(recipe.settings) if dataclasses.is_dataclass(recipe.settings) else {}
    set_ = [k for k, plain in CHOSEN_ON_DATA.items() if k in own and own[k] not in (plain, (), [])]
    return [k if isinstance(own[k], (list, tuple, bool)) else f"{k}: {own[k]}" for k in set_]


def _unit_of(name: str, unit: str) -> str:
    m = _BLOCK.match(name) if unit == "block" else None
    return m.group(1) if m else name


def zero_point_layers(recipe, names: list[str]) -> frozenset[str]:
    """The layers among ``names`` that ``recipe``'s ``zero_points`` globs take (at a group-wise scheme the run gives
    each an 8-bit GEMM of its group means, ``recipes/zero_points.py``; ``measure`` measures them so,
    ``_zero_point_copies``)."""
    from qharness.recipes.zero_points import chosen

    return frozenset(chosen(names, getattr(recipe.settings, "zero_points", None) or ()))


def unit_bytes(linears: dict, members: list[str], schemes, zero_points: frozenset[str]) -> dict[str, int]:
    """``{scheme: bytes}`` of a unit's layers ``members`` (``weight_bytes``; ``zero_points``: ``zero_point_layers``)."""
    return {c: sum(weight_bytes(linears[n], c, n in zero_points) for n in members) for c in schemes}


def weight_bytes(module, scheme: str, zero_point: bool = False) -> int:
    """Estimated bytes of a linear's weight (+ bias) in an XNNPACK ``.pte`` under ``scheme``; ``zero_point``: with
    the 8-bit GEMM of its group means at a group-wise scheme (int8 ``[out, in / group]``, an fp32 scale a row, and
    that GEMM's program bytes, ``OVERHEAD_PER_LAYER_BYTES``; the layer's own are ``autotune.rest_bytes``')."""
    out, numel = module.weight.shape[0], module.weight.numel()
    bias = 4 * module.bias.numel() if getattr(module, "bias", None) is not None else 0
    if scheme == FP:
        return 4 * numel + bias
    rule = candidate_rule(scheme)
    values = (
        numel * max(rule["weight_bits"], 4) // 8
    )  # 2/3-bit values are stored as int4 (upstream/fixes/xnnpack_subbyte)
    scales = 4 * out if rule["group_size"] is None else 2 * (numel // rule["group_size"])  # fp32 / bf16 scales
    grouped = zero_point and rule["group_size"] is not None
    offsets = numel // rule["group_size"] + 4 * out + OVERHEAD_PER_LAYER_BYTES if grouped else 0
    return values + scales + bias + offsets


class _Swapper:
    """Put modules into ``model`` by name and take them back out."""

    def __init__(self, model):
        self.model = model

    def put(self, modules: dict):
        old = {}
        for name, module in modules.items():
            parent, _, attr = name.rpartition(".")
            owner = self.model.get_submodule(parent) if parent else self.model
            old[name] = getattr(owner, attr)
            setattr(owner, attr, module)
        return old


def _quantized_copies(fp_modules: dict, quantizer) -> dict | None:
    """Copies of ``fp_modules`` quantized by ``quantizer`` (torchao ``quantize_``), or None when it cannot quantize
    every one of them (e.g. a group size that does not divide an input size)."""
    import torch

    holder = torch.nn.ModuleDict({str(i): copy.deepcopy(m) for i, m in enumerate(fp_modules.values())})
    if len(quantizer.assignment(holder)) != len(holder):
        return None
    quantizer.convert(holder)
    return {name: holder[str(i)] for i, name in enumerate(fp_modules)}


def _zero_point_copies(fp_modules: dict, quantizer) -> dict | None:
    """Copies of ``fp_modules`` (a unit holding zero-point layers) as the run deploys them at min-max: under their
    own names, so that the recipe's ``zero_points`` globs take them, split into a symmetric 4-bit part and 8-bit
    offsets, the other layers rounded, all quantized with those scales (``recipes/rounding.py``, ``weighted`` off);
    None when ``quantizer`` (``_settings(..., zero_points=True)``) cannot quantize every one."""
    import torch

    from qharness.recipes.rounding import round_weights

    holder = torch.nn.Module()
    for name, m in fp_modules.items():
        *path, leaf = name.split(".")
        parent = holder
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, torch.nn.Module())
            parent = parent._modules[part]
        parent.add_module(leaf, copy.deepcopy(m))
    if len(quantizer.assignment(holder)) != len(fp_modules):
        return None
    rounded = round_weights(holder, quantizer, None, weighted=False)
    rounded.load(holder)
    quantizer.convert(holder, rounded.qparams)
    return {name: holder.get_submodule(name) for name in fp_modules}


def _units(fp_model, recipe, candidates: list[str], unit: str):
    """The candidates' quantizers, the model's linears by name, and ``{unit: [layer names]}`` of the layers some
    candidate quantizes (``recipe``: the scheme recipe)."""
    import torch

    quantizers = {c: _quantizer(recipe, c) for c in candidates}
    linears = {n: m for n, m in fp_model.named_modules() if isinstance(m, torch.nn.Linear)}
    names = [
        n
        for n, m in linears.items()
        if any(q is not None and q.assignment(torch.nn.ModuleDict({"m": m})) for q in quantizers.values())
    ]
    if not names:
        raise UserError(f"no candidate quantizes a layer of {type(fp_model).__name__}", fix="--candidates 8da8w-pc")
    units: dict[str, list[str]] = {}
    for n in names:
        units.setdefault(_unit_of(n, unit), []).append(n)
    return quantizers, linears, units


def unit_sizes(fp_model, recipe, candidates: list[str], unit: str = "layer") -> list[dict]:
    """Without scoring anything: each unit's ``name``, ``layers`` and ``weight_bytes`` for ``fp`` and each candidate
    that quantizes all its layers (what ``measure`` reports as applicable); for a size check before measuring."""
    import torch

    recipe = scheme_recipe(recipe, "fp")
    quantizers, linears, units = _units(fp_model, recipe, candidates, unit)
    zero_points = zero_point_layers(recipe, list(linears))
    out = []
    for u, members in units.items():
        ok = [
            c
            for c in candidates
            if quantizers[c] is None
            or all(quantizers[c].assignment(torch.nn.ModuleDict({"m": linears[n]})) for n in members)
        ]
        out.append(
            {
                "name": u,
                "layers": members,
                "weight_bytes": unit_bytes(linears, members, [*ok, FP], zero_points),
                "results": {c: {"applicable": True, "ppl_ratio": 1.0} for c in ok},
            }
        )
    return out


def shared_table_bytes(fp_model, recipe, candidates: list[str]) -> dict[str, dict[str, int]]:
    """``{output projection: {candidate: bytes}}``: the int8 values a tied output projection keeps once with its
    lookup table when the candidate gives it the table's values (``recipe``'s 8-bit per-row table, e.g.
    ``xnnpack_8da4w_tied8``: the lowering stores them once, ``deploy/shared_table.py``); empty when nothing is shared.
    ``autotune`` takes these bytes off that unit's size, as the program does.

    Example::

        shared_table_bytes(smollm2, load_recipe("xnnpack_8da4w_tied8"), ["8da8w-pc", "8da4w-g32"])
        # {"lm_head": {"8da8w-pc": 28311552}}
    """
    import torch
    from torchao.quantization import quantize_

    from qharness.sources.models import tied_tables

    recipe = scheme_recipe(recipe, "fp")
    quant = recipe.table_quant(True)
    tables = tied_tables(fp_model)
    if quant is None or quant.bits != 8 or quant.group_size is not None or not tables:
        return {}
    head = fp_model.get_output_embeddings()
    name = next(n for n, m in fp_model.named_modules() if m is head)
    table = torch.nn.ModuleDict({"t": copy.deepcopy(fp_model.get_submodule(next(iter(tables))))})
    quantize_(table, quant.torchao_config(), filter_fn=lambda m, _: isinstance(m, torch.nn.Embedding))
    values = table["t"].weight.qdata
    shared = {}
    for c in candidates:
        quantizer = _quantizer(recipe, c)
        copies = None if quantizer is None else _quantized_copies({name: head}, quantizer)
        weight = None if copies is None else getattr(copies[name].weight, "qdata", None)
        if weight is not None and weight.dtype == values.dtype and torch.equal(weight, values):
            shared[c] = values.numel() * values.element_size()
    return {name: shared} if shared else {}


def measure(
    fp_model,
    recipe,
    x,
    y,
    batch_size: int,
    candidates: list[str],
    unit: str = "layer",
    against: str = "fp",
    progress: bool = True,
) -> dict:
    """Score every (unit, candidate) on validation blocks ``x``/``y`` against the baseline (``against``); returns
    the JSON-ready result (``write_outputs``). ``fp_model`` (an HF causal LM, eval mode) is left as it was."""
    import torch

    from qharness.checks.parity import score_batched
    from qharness.checks.stats import loss_interval
    from qharness.progress import bar

    t0 = time.perf_counter()
    recipe = scheme_recipe(recipe, against)
    quantizers, linears, units = _units(fp_model, recipe, candidates, unit)
    zero_points = zero_point_layers(recipe, list(linears))
    with_zero_points = _zero_point_quantizers(recipe, candidates) if zero_points else {}
    model, schemes = _baseline(fp_model, recipe, [n for members in units.values() for n in members], against)
    swap = _Swapper(model)

    def score(desc=None):
        with torch.no_grad():
            return score_batched(lambda b: model(input_ids=b, use_cache=False).logits, x, y, batch_size, desc=desc)

    base = score("scoring the baseline" if progress else None)
    jobs = [(u, c) for u, members in units.items() for c in candidates if any(schemes[n] != c for n in members)]
    results: dict[str, dict] = {u: {} for u in units}
    for u, c in bar(jobs, f"sensitivity ({unit} x precision)", unit="model") if progress else jobs:
        members = {n: linears[n] for n in units[u]}
        if quantizers[c] is None:
            new = dict(members)
        elif c in with_zero_points and zero_points & set(members):
            new = _zero_point_copies(members, with_zero_points[c])
        else:
            new = _quantized_copies(members, quantizers[c])
        results[u][c] = {"applicable": False} if new is None else _changed(swap, new, score, base)
    return {
        "schema_version": SCHEMA_VERSION,
        "recipe": recipe.name,
        "measured_without": measured_without(recipe),
        "against": against,
        "unit": unit,
        "candidates": {c: candidate_rule(c) for c in candidates},
        "baseline": {
            "ppl": base["ppl"],
            "loss": base["loss"],
            **loss_interval(base["block_losses"]),
            "schemes": schemes,
        },
        "units": [
            _unit_record(u, members, linears, candidates, results[u], base, zero_points) for u, members in units.items()
        ],
        "eval_blocks": len(x),
        "seq_len": int(x.shape[1]),
        "evaluations": len(jobs) + 1,
        "wall_s": time.perf_counter() - t0,
    }


def _zero_point_quantizers(recipe, candidates: list[str]) -> dict:
    """``{candidate: quantizer}`` with the recipe's zero points, for the group-wise candidates (a per-channel layer
    has none in the run either)."""
    grouped = [c for c in candidates if candidate_rule(c).get("group_size") is not None]
    return {c: _quantizer(recipe, c, zero_points=True) for c in grouped}


def _baseline(fp_model, recipe, names: list[str], against: str):
    """The model every change is made in and each layer's scheme there: ``fp``: ``fp_model`` itself, every layer FP;
    ``recipe``: a copy quantized by the (scheme) recipe."""
    if against != "recipe":
        return fp_model, {n: FP for n in names}
    model = copy.deepcopy(fp_model)
    applied = recipe.make_quantizer(is_qat=False).convert(model)
    return model, {n: applied.get(n, FP) for n in names}


def _changed(swap: _Swapper, new: dict, score, base: dict) -> dict:
    """One cell: the model scored with ``new`` modules put in (and taken out again), paired against ``base``."""
    from qharness.checks.stats import paired_ratio

    old = swap.put(new)
    try:
        scored = score()
    finally:
        swap.put(old)
    r = paired_ratio(scored["block_losses"], base["block_losses"])
    lo, hi = r["ci"] or (None, None)
    return {
        "applicable": True,
        "ppl": scored["ppl"],
        "ppl_ratio": r["ppl_ratio"],
        "ci": r["ci"],
        "significant": lo is not None and (lo > 1 or hi < 1),
    }


def _unchanged(base: dict) -> dict:
    """The cell of a unit already at that scheme in the baseline: no change, ratio 1."""
    return {
        "applicable": True,
        "ppl": base["ppl"],
        "ppl_ratio": 1.0,
        "ci": [1.0, 1.0],
        "baseline": True,
        "significant": False,
    }


def _unit_record(
    u: str, members: list[str], linears: dict, candidates: list[str], results: dict, base: dict, zero_points: frozenset
) -> dict:
    """A unit's entry of the result: its layers, parameters, weight bytes per scheme (``unit_bytes``) and a cell per
    candidate (the baseline's own scheme: no change, ratio 1)."""
    return {
        "name": u,
        "layers": members,
        "params": sum(linears[n].weight.numel() for n in members),
        "weight_bytes": unit_bytes(linears, members, dict.fromkeys([*candidates, FP]), zero_points),
        "results": {c: results[c] if c in results else _unchanged(base) for c in candidates},
    }


def _cell(r: dict) -> str:
    if not r.get("applicable", True):
        return "n/a"
    if r.get("baseline"):
        return "(baseline)"
    ci = r["ci"]
    band = f" [{ci[0] - 1:+.2%}, {ci[1] - 1:+.2%}]" if ci else ""
    return f"{r['ppl_ratio'] - 1:+.2%}{band}{' *' if r['significant'] else ''}"


def format_table(result: dict) -> str:
    """The unit x candidate table: the perplexity change vs the baseline with its 95% paired band (``*``: outside
    the band of no change)."""
    cands = list(result["candidates"])
    b = result["baseline"]
    what = "quantized alone, the rest FP" if result["against"] == "fp" else f"changed alone in {result['recipe']}"
    rows = [(result["unit"], *cands)]
    rows += [(u["name"], *(_cell(u["results"][c]) for c in cands)) for u in result["units"]]
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    ci = b.get("ppl_ci")
    lines = [
        f"sensitivity: validation perplexity change per {result['unit']} ({what}), converted model, "
        f"{result['eval_blocks']} blocks of {result['seq_len']} tokens; baseline ppl {b['ppl']:.3f}"
        + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
        + without_note(result),
        *("  ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows),
        f"[lo, hi]: 95% interval of the paired per-block differences; *: no change lies outside it (by chance alone "
        f"about 1 cell in 20 is starred); {result['evaluations']} models scored in {result['wall_s']:.1f}s",
    ]
    return "\n".join(lines)


def without_note(result: dict) -> str:
    """``; min-max weights: the recipe's rounding: weighted, ... choose them in the run`` when the table was measured
    without some of the recipe's settings (``measured_without``), else empty."""
    without = result.get("measured_without") or []
    return f"; min-max weights: the recipe's {', '.join(without)} choose them in the run" if without else ""


def plot(result: dict, path: Path) -> Path:
    """Heat map (unit x candidate) of the perplexity change in %, each cell annotated; hatched: not applicable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cands = list(result["candidates"])
    units = result["units"]
    values = [
        [
            (u["results"][c]["ppl_ratio"] - 1) * 100 if u["results"][c].get("applicable", True) else math.nan
            for c in cands
        ]
        for u in units
    ]
    finite = [abs(v) for row in values for v in row if not math.isnan(v)]
    limit = max(finite + [1e-6])
    fig, ax = plt.subplots(figsize=(1.6 * len(cands) + 3, 0.32 * len(units) + 1.8))
    image = ax.imshow(values, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    ax.set_xticks(range(len(cands)), cands)
    ax.set_yticks(range(len(units)), [u["name"] for u in units], fontsize=7)
    for i, u in enumerate(units):
        for j, c in enumerate(cands):
            r = u["results"][c]
            text = "n/a" if math.isnan(values[i][j]) else f"{values[i][j]:+.2f}{'*' if r.get('significant') else ''}"
            ax.text(j, i, text, ha="center", va="center", fontsize=6)
    fig.colorbar(image, ax=ax, label=f"perplexity change vs {result['against']} baseline (%)")
    ax.set_title(f"{result['recipe']}: sensitivity per {result['unit']} (*: outside the 95% paired band)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(result: dict, out_dir: Path) -> dict[str, Path]:
    """``sensitivity.json``, ``sensitivity.md`` (the table) and ``sensitivity.png`` (the heat map) in ``out_dir``."""
    from qharness.io.atomic import write_bytes_atomic, write_json_atomic

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "sensitivity.json",
        "table": out_dir / "sensitivity.md",
        "png": out_dir / "sensitivity.png",
    }
    write_json_atomic(paths["json"], result)
    write_bytes_atomic(paths["table"], ("```\n" + format_table(result) + "\n```\n").encode())
    plot(result, paths["png"])
    return paths
