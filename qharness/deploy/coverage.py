"""How much of a model its deployed program quantized: every linear weight, quantized or float, and why.

``inventory(model)`` lists the model's linear projections (``nn.Linear`` modules, plain once ``sources/normalize.py``
ran, and ``Conv1D``-style ones it could not swap) with their weights' bytes, before anything is quantized.
``measure(graph, inventory, recipe, quantizer, assignment)`` reads the converted deploy graph: every matmul-like op
(``aten.linear``, ``addmm``, ``matmul``, ``mm``, ``bmm``, ...) whose operand is a weight reads it either dequantized
(quantized) or as the float parameter itself (float). A float weight says why:

- ``fp recipe``: the recipe quantizes nothing (fraction 0, no failure);
- ``recipe rule``: a ``layers:`` rule of the recipe keeps it in floating point (``recipes/layers.py``);
- ``recipe settings: ...``: the quantizer's settings do not take it (e.g. a group size that does not divide its
  input size; a warning);
- anything else is a failure: the op that computes it, where the quantizer did not see a linear layer it takes.

``check`` raises ``UserError`` naming the failures, so a recipe never ships as quantized with float projections it
meant to quantize. The record is ``summary.json``'s ``coverage`` (``coverage_record.Coverage``: fraction of linear
weight bytes quantized, per rule, each float weight).

Example::

    layers = inventory(model)                         # before quantization
    cov = measure(converted, layers, recipe, quantizer, assignment)
    check(cov, recipe.name, "GPT2LMHeadModel")        # UserError: ... transformer.h.0.attn.c_attn (aten.addmm) ...
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch

from qharness.deploy.coverage_record import (
    CONV_FLOAT,
    CONV_MULTIPLY_ADDS,
    Convolution,
    Coverage,
    EmbeddingTable,
    FloatWeight,
    RuleCoverage,
)
from qharness.errors import UserError

log = logging.getLogger(__name__)

# aten ops that multiply an operand by a weight matrix
MATMULS = frozenset(
    {"linear", "addmm", "matmul", "mm", "bmm", "baddbmm", "addbmm", "einsum", "_grouped_mm", "addmv", "mv"}
)
# ops a weight passes through on its way to a matmul without being computed on (layout, views, dtype, slices)
THROUGH = frozenset(
    {
        "t",
        "numpy_T",
        "transpose",
        "permute",
        "view",
        "reshape",
        "_unsafe_view",
        "expand",
        "clone",
        "contiguous",
        "unsqueeze",
        "squeeze",
        "alias",
        "detach",
        "_to_copy",
        "to",
        "type_as",
        "slice",
        "select",
        "index_select",
        "unbind",
        "split",
        "split_with_sizes",
        "chunk",
        "flatten",
        "unflatten",
        "lift_fresh_copy",
        "access_subclass_inner_tensor",  # torchao's quantized weight: its int data, scale and zero point
    }
)
CONVOLUTIONS = frozenset({"conv1d", "conv2d", "convolution", "_convolution"})  # aten ops convolving with a weight
FP_RECIPE, RULE = "fp recipe: the recipe quantizes nothing", "recipe rule"
DEFAULT_RULE = "recipe"  # the rule of every weight no ``layers:`` rule takes


@dataclass(frozen=True)
class Inventory:
    """A model's linear weights before quantization: ``linears`` ``{module name: weight bytes}`` (``plain``: those
    that are plain ``nn.Linear``), and every float parameter of 2 or more dimensions ``{name: bytes}`` (for weights
    computed outside linear modules, e.g. experts held as one 3-D tensor)."""

    linears: dict[str, int]
    plain: frozenset[str]
    params: dict[str, int]
    embeddings: dict[str, tuple[int, int]] = field(default_factory=dict)  # {name: (rows, row width)}
    tied: dict[str, str] = field(default_factory=dict)  # {embedding name: the output head sharing its weight}
    convs: dict[str, int] = field(default_factory=dict)  # {nn.Conv1d module name: weight bytes} (LFM2's convolutions)


def inventory(model: torch.nn.Module) -> Inventory:
    from qharness.sources.models import tied_tables
    from qharness.sources.normalize import is_projection

    linears, plain = {}, set()
    for name, m in model.named_modules():
        if is_projection(m):
            linears[name] = m.weight.numel() * m.weight.element_size()
            if type(m) is torch.nn.Linear:
                plain.add(name)
    params = {
        n: p.numel() * p.element_size()
        for n, p in model.named_parameters(remove_duplicate=False)
        if p.is_floating_point() and p.dim() >= 2
    }
    embeddings = {
        name: (m.num_embeddings, m.embedding_dim)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding)
    }
    names = {id(m): name for name, m in model.named_modules()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = {} if head is None else {t: names[id(head)] for t in tied_tables(model)}
    convs = {
        name: m.weight.numel() * m.weight.element_size()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Conv1d)
    }
    return Inventory(linears, frozenset(plain), params, embeddings, tied, convs)


def _op(node: torch.fx.Node) -> str:
    """``aten.addmm.default`` -> ``addmm``; ``operator.getitem`` -> ``getitem``; '' for other nodes."""
    if node.op != "call_function":
        return ""
    if node.target is operator.getitem:
        return "getitem"
    return getattr(node.target, "_opname", "") or getattr(node.target, "__name__", "")


def _origin(node, params: set[str]) -> tuple[str, str | None]:
    """What a matmul operand is: ``("float", parameter name)``, ``("quantized", the stored constant's name)`` (a
    weight read through a dequantize op), or ``("activation", None)``."""
    while isinstance(node, torch.fx.Node):
        if node.op == "get_attr":
            return ("float", node.target) if node.target in params else ("activation", None)
        op = _op(node)
        if op.startswith("dequantize"):
            stored = _stored(node.args[0]) if node.args else None
            return ("quantized", stored) if stored is not None else ("activation", None)
        if op not in THROUGH and op != "getitem":
            return ("activation", None)
        node = node.args[0] if node.args else None
    return ("activation", None)


def _stored(node) -> str | None:
    """The constant ``node`` reads through layout ops only (a quantized weight's integer data), or None (computed
    at run time: an activation quantized on the fly)."""
    while isinstance(node, torch.fx.Node):
        if node.op == "get_attr":
            return node.target
        if _op(node) not in THROUGH and _op(node) != "getitem":
            return None
        node = node.args[0] if node.args else None
    return None


def _match(path: str, names) -> str | None:
    """The longest of ``names`` that ``path`` (a graph's module path or parameter target, under the export's wrapper
    modules) ends with, or None."""
    parts = path.split(".")
    return next((".".join(parts[k:]) for k in range(len(parts)) if ".".join(parts[k:]) in names), None)


def _module_of(node: torch.fx.Node, names) -> str | None:
    """The linear module of ``names`` a node computes in: the innermost on its module stack, or the ``nn.Linear`` a
    ``moe.linear_router`` reads its weight from (the router's own ``F.linear`` runs in the router module)."""
    from qharness.sources.moe import ROUTER_LINEAR

    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        found = _match(path, names) or _match(f"{path}.{ROUTER_LINEAR}", names)
        if found is not None:
            return found
    return None


def weight_uses(graph: torch.fx.GraphModule, layers: Inventory) -> dict[str, tuple[str, str]]:
    """``{weight name: (status, op)}`` for every weight a matmul-like op of ``graph`` reads: status ``quantized`` or
    ``float`` (float wins when a weight is read both ways), ``op`` the op reading it (``linear``, ``addmm``, ...).
    Names are the model's: a linear module's name, or a parameter's for weights outside linear modules."""
    params = dict(graph.named_parameters(remove_duplicate=False))
    params = {n for n, p in params.items() if p.is_floating_point() and p.dim() >= 2}
    uses: dict[str, tuple[str, str]] = {}
    for node in graph.graph.nodes:
        op = _op(node)
        if op not in MATMULS:
            continue
        for arg in node.all_input_nodes:
            status, target = _origin(arg, params)
            if status == "activation":
                continue
            name = _module_of(node, layers.linears)
            if name is None and target is not None:
                param = _match(target, layers.params)
                module = param.removesuffix(".weight") if param else None
                name = module if module in layers.linears else param
            if name is None:
                continue
            if uses.get(name, ("",))[0] != "float":
                uses[name] = (status, op)
    return uses


def embedding_tables(
    graph: torch.fx.GraphModule, layers: Inventory, recipe, assignment: dict | None = None
) -> dict[str, EmbeddingTable]:
    """The embedding tables ``graph`` looks up (``aten.embedding``), each as the program stores it: quantized (read
    through a dequantize op, at the recipe's ``embedding_bits``, or its ``layers:`` rule's from ``assignment``) or
    float, and for a tied table the cost of its second copy (``recipes/embedding.py``: the pip runtime has no
    shared-table kernel)."""
    from qharness.recipes.embedding import SHARED_TABLE_MISSING, EmbeddingQuant

    params = {n for n, p in graph.named_parameters(remove_duplicate=False) if p.is_floating_point() and p.dim() >= 2}
    tables: dict[str, EmbeddingTable] = {}
    for node in graph.graph.nodes:
        if _op(node) != "embedding" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        status, target = _origin(node.args[0], params)
        name = _module_of(node, layers.embeddings) or (
            target and _match(target.removesuffix(".weight"), layers.embeddings)
        )
        if name is None:
            continue
        rows, width = layers.embeddings[name]
        size = rows * width * 4
        scheme = (assignment or {}).get(name)
        head = layers.tied.get(name)
        quant = EmbeddingQuant.from_scheme(scheme) if scheme else recipe.table_quant(tied=head is not None)
        quantized = status == "quantized" and quant is not None
        stored = quant.stored_bytes(rows, width) if quantized else size
        note = f"{SHARED_TABLE_MISSING}; the copy costs {stored} bytes" if head and quantized else None
        tables[name] = EmbeddingTable(
            bits=quant.bits if quantized else None,
            group_size=quant.group_size if quantized else None,
            bytes=size,
            stored_bytes=stored,
            tied_to=head,
            shared=False,
            note=note,
        )
    return tables


def convolutions(graph: torch.fx.GraphModule, layers: Inventory) -> dict[str, Convolution]:
    """The ``nn.Conv1d`` weights ``graph`` convolves with (``aten.conv1d`` / ``convolution``), quantized (read through a
    dequantize op) or float, by module name: a recurrent layer's short convolution, outside the linear counts."""
    params = {n for n, p in graph.named_parameters(remove_duplicate=False) if p.is_floating_point() and p.dim() >= 2}
    found: dict[str, Convolution] = {}
    for node in graph.graph.nodes:
        op = _op(node)
        if op not in CONVOLUTIONS or len(node.args) < 2:
            continue
        status, target = _origin(node.args[1], params)
        if status == "activation":
            continue
        name = _module_of(node, layers.convs) or (target and _match(target.removesuffix(".weight"), layers.convs))
        if name is None:
            continue
        quantized = status == "quantized"
        found[name] = Convolution(
            op=op, bytes=layers.convs[name], quantized=quantized, note=None if quantized else CONV_FLOAT
        )
    for node in graph.graph.nodes:  # a convolution computed as multiply-adds (fastpath/state_cache.causal_conv)
        if node.op != "get_attr" or node.target not in params:
            continue
        name = _match(node.target.removesuffix(".weight"), layers.convs)
        if name is not None and name not in found:
            found[name] = Convolution(op="mul", bytes=layers.convs[name], quantized=False, note=CONV_MULTIPLY_ADDS)
    return found


def rule_of(quantizer, name: str) -> str:
    """The recipe rule a module falls under: ``recipe`` or ``layers[i] (match 'pattern')`` (``recipes/layers.py``)."""
    owner = getattr(quantizer, "owner", None)
    if owner is None:
        return DEFAULT_RULE
    i = owner(name)
    return DEFAULT_RULE if i < 0 else f"layers[{i}] (match {quantizer.rules[i][0]!r})"


def _why(name: str, op: str, recipe, quantizer, assignment: dict | None, layers: Inventory) -> tuple[str, bool]:
    """Why a weight stayed float, and whether that is a failure."""
    from qharness.recipes.layers import FP

    if recipe.kind == "fp":
        return FP_RECIPE, False
    if assignment is not None:
        scheme = assignment.get(name)
        if scheme == FP:
            return RULE, False
        if scheme is None and name in layers.plain:
            what = "; ".join(dict.fromkeys(step.what for step in quantizer.configs))
            return f"recipe settings: not among {what}", False
    return f"computed by aten.{op}, which the recipe's quantizer did not quantize", True


def measure(graph: torch.fx.GraphModule, layers: Inventory, recipe, quantizer, assignment: dict | None) -> Coverage:
    """The coverage record of a converted deploy graph (``summary.json``'s ``coverage``): totals and the byte
    ``fraction`` quantized, the same per recipe rule (``rules``), each float weight with why (``float``) and the
    linear modules the program never reads (``unused``, counted nowhere)."""
    uses = weight_uses(graph, layers)
    sizes = {**{n: layers.params[n] for n in uses if n not in layers.linears and n in layers.params}, **layers.linears}
    rules: dict[str, dict] = {}
    floats, unused = {}, []
    for name, size in sizes.items():
        if name not in uses:
            unused.append(name)
            continue
        status, op = uses[name]
        rule = rule_of(quantizer, name)
        entry = rules.setdefault(rule, {"rule": rule, "weights": 0, "bytes": 0, "quantized": 0, "quantized_bytes": 0})
        entry["weights"] += 1
        entry["bytes"] += size
        if status == "quantized":
            entry["quantized"] += 1
            entry["quantized_bytes"] += size
        else:
            why, failure = _why(name, op, recipe, quantizer, assignment, layers)
            floats[name] = FloatWeight(rule=rule, why=why, failure=failure, op=op, bytes=size)
    total = {k: sum(r[k] for r in rules.values()) for k in ("weights", "bytes", "quantized", "quantized_bytes")}
    return Coverage(
        **total,
        fraction=total["quantized_bytes"] / total["bytes"] if total["bytes"] else 0.0,
        rules=[RuleCoverage(**r) for r in sorted(rules.values(), key=lambda r: (r["rule"] != DEFAULT_RULE, r["rule"]))],
        float=floats,
        unused=sorted(unused),
        embeddings=embedding_tables(graph, layers, recipe, assignment),
        convolutions=convolutions(graph, layers),
    )


def check(coverage: Coverage, recipe: str, arch: str) -> None:
    """``UserError`` naming the projections ``recipe`` meant to quantize and left float (computed outside an
    ``nn.Linear`` the quantizer takes). Those its settings do not take (an input width its ``group_size`` does not
    divide: Gemma 3n's ``per_layer_projection``, ``laurel``, AltUp) stay float by the recipe's own rule: a note on
    stderr names them, their bytes and the ``layers:`` rule that quantizes them per channel instead (``coverage.float``
    records each with its ``why``)."""
    note = settings_note(coverage, recipe)
    if note:
        import sys

        log.info(note)
        print(f"note: {note}", file=sys.stderr)
    failed = coverage.failures()
    if not failed:
        return
    shown = ", ".join(f"{n} (aten.{coverage.float[n].op})" for n in list(failed)[:4])
    more = f", ... ({len(failed)} in all)" if len(failed) > 4 else ""
    raise UserError(
        f"recipe {recipe!r} would leave {len(failed)} of {coverage.weights} linear projections of {arch} in floating "
        f"point, computed outside an nn.Linear the quantizer takes: {shown}{more}",
        fix="use a model whose projections are nn.Linear layers (qharness swaps transformers' Conv1D and nn.Linear "
        "subclasses that compute a plain linear), or the FP recipe xnnpack_fp32",
    )


def settings_note(coverage: Coverage, recipe: str) -> str | None:
    """The note of ``check`` on the projections the recipe's settings leave float, with the per-channel ``layers:``
    rule a user would add (None: there are none)."""
    kept = {n: f for n, f in coverage.float.items() if f.why.startswith("recipe settings")}
    if not kept:
        return None
    nbytes = sum(f.bytes for f in kept.values())
    names = list(kept)
    # one glob per distinct leaf name (model.layers.3.per_layer_projection -> *per_layer_projection)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    rules = ", ".join(f'{{match: "*{leaf}", group_size: null}}' for leaf in leaves[:6])
    shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
    return (
        f"recipe {recipe} keeps {len(names)} linear layer(s) in floating point, {nbytes / max(coverage.bytes, 1):.1%} "
        f"of the linear weight bytes ({next(iter(kept.values())).why}): {shown}; to quantize them per channel "
        f"instead, add to the recipe `layers: [{rules}]` (or `quant: fp` rules to keep them float on purpose)"
    )


def check_embeddings(coverage: Coverage, recipe, model) -> None:
    """``UserError`` when the recipe quantizes embeddings (``embedding_bits``, ``untied_embedding_bits``) and a table it
    takes is looked up in floating point in the program (a quantized table that did not reach the program must not
    ship as quantized)."""
    modules = dict(model.named_modules())
    left = {}
    for n, t in coverage.embeddings.items():
        quant = recipe.table_quant(tied=t.tied_to is not None)
        if quant is not None and t.bits is None and n in modules and quant.takes(modules[n]):
            left[n] = quant.bits
    if left:
        raise UserError(
            f"recipe {recipe.name!r} quantizes embeddings to {'/'.join(map(str, sorted(set(left.values()))))} bits "
            f"but the program looks up {', '.join(left)} in floating point",
            fix="set embedding_bits: null in the recipe to keep them float, or report the model (its embedding is "
            "not an nn.Embedding lookup the quantizer sees)",
        )


def format_coverage(coverage: Coverage | None) -> str | None:
    """One line for the run's table: ``quantized: 96.9% of linear weight bytes (13 of 14 weights; float: lm_head
    (recipe rule)); embeddings: model.embed_tokens 4-bit (groups of 32), a copy apart from the tied lm_head``; None without a record (summaries written before coverage was measured)."""
    if not coverage:
        return None
    line = (
        f"quantized: {coverage.fraction:.1%} of linear weight bytes ({coverage.quantized} of {coverage.weights} weights"
    )
    floats = coverage.float
    if floats:
        whys = list(dict.fromkeys(f.why for f in floats.values()))
        names = ", ".join(list(floats)[:3]) + (f", ... ({len(floats)} in all)" if len(floats) > 3 else "")
        line += f"; float: {names} ({'; '.join(whys)})"
    line += ")"
    tables = {n: t for n, t in (getattr(coverage, "embeddings", None) or {}).items() if t.bits is not None}
    if tables:  # the quantized ones (float tables are the default, as before embeddings were recorded)
        line += "; embeddings: " + ", ".join(
            f"{n} {t.bits}-bit ({'per row' if t.group_size is None else f'groups of {t.group_size}'})"
            + (f", a copy apart from the tied {t.tied_to}" if t.tied_to and not t.shared else "")
            + (f", one copy with the tied {t.tied_to}" if t.tied_to and t.shared else "")
            for n, t in tables.items()
        )
    convs = getattr(coverage, "convolutions", None) or {}
    kept = [n for n, c in convs.items() if not c.quantized]
    if kept:
        nbytes = sum(convs[n].bytes for n in kept)
        names = ", ".join(kept[:2]) + (f", ... ({len(kept)} in all)" if len(kept) > 2 else "")
        line += f"; float convolutions ({nbytes / 1024:.1f} KiB, as recurrent layers keep them): {names}"
    return line
