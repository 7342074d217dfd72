"""Per-layer quantization: a recipe's ``layers:`` rules give modules chosen by name other settings, or keep them FP.

Rules are read with the recipe (typed, checked without torch); their patterns are checked against the model when
the quantizer first sees it, before training or calibration. First match wins; a module no rule matches takes the
recipe's own settings. Patterns are ``fnmatch`` globs on the HF module names (``model.layers.0.self_attn.q_proj``,
``lm_head``); a rule's keys other than ``match`` are the quantizer's settings for those modules (``learn_scales`` is
recipe-wide), or ``quant: fp``. Source-level quantizers only (``torchao_8da4w``: ``weight_bits``, ``group_size``
(null: per channel), ``embedding_bits``, ``choose_qparams``).

Example (a recipe file; ``qharness autotune`` writes one rule per layer the same way)::

    base: xnnpack_8da4w
    layers:
      - {match: "lm_head", quant: fp}
      - {match: "model.layers.0.*", weight_bits: 8, group_size: null}

``PerLayerQuantizer.check(model)`` returns the assignment ``{module name: scheme}`` (``fp`` for a quantizable module
a rule keeps in floating point) that ``summary.json`` records as ``layers``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from qharness.errors import UserError
from qharness.recipes.registration import SourceQuantizer, parse_settings

log = logging.getLogger(__name__)

FP = "fp"  # the scheme of a module a rule keeps in floating point
# settings a rule cannot change (QAT's trained state is the recipe's; the output projection's input is one)
RECIPE_WIDE = ("learn_scales", "split_head_input")
EXAMPLE = 'layers: [{match: "lm_head", quant: fp}, {match: "model.layers.0.*", weight_bits: 8, group_size: null}]'


@dataclass(frozen=True)
class LayerRule:
    """``match``: an fnmatch glob on module names; ``settings``: the quantizer's settings for the modules it takes
    (None: they stay in floating point); ``raw``: the rule as written (recorded in ``summary.json``)."""

    match: str
    settings: Any
    raw: dict


def parse_layers(value, recipe: str, quantizer: str | None, kind: str, settings) -> tuple[LayerRule, ...]:
    """A recipe's ``layers:`` list as typed rules (``UserError`` naming the rule and field otherwise)."""
    where = f"recipe {recipe!r} layers"
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        raise UserError(f"{where} must be a non-empty list of rules (got {value!r})", fix=f"e.g. {EXAMPLE}")
    if quantizer is None:
        raise UserError(
            f"{where}: the recipe quantizes nothing, so no layer can be overridden", fix="base: xnnpack_8da4w"
        )
    if kind != "source":
        raise UserError(
            f"{where}: per-layer settings need a source-level quantizer (torchao_8da4w); {quantizer!r} quantizes the "
            "exported graph",
            fix="base: xnnpack_8da4w (its layers can be int4 group-wise, int4 or int8 per channel, or fp)",
        )
    known = [f.name for f in dataclasses.fields(settings) if f.name not in RECIPE_WIDE]
    rules = []
    for i, rule in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(rule, dict):
            raise UserError(f"{at} must be a mapping (got {rule!r})", fix=f"e.g. {EXAMPLE}")
        match = rule.get("match")
        if not isinstance(match, str) or not match:
            raise UserError(
                f"{at}: match must be a module-name pattern (got {match!r})",
                fix='e.g. match: "model.layers.0.*" (an fnmatch glob on names such as model.layers.0.mlp.up_proj)',
            )
        rest = {k: v for k, v in rule.items() if k != "match"}
        unknown = sorted(set(rest) - set(known) - {"quant"})
        if unknown:
            wide = [k for k in unknown if k in RECIPE_WIDE]
            raise UserError(
                f"{at}: {'recipe-wide' if wide else 'unknown'} setting(s) {', '.join(unknown)}",
                fix=f"a rule takes match and quant: fp, or settings among {', '.join(known)}"
                + (f"; set {', '.join(wide)} in the recipe's quantizer" if wide else ""),
            )
        if "quant" in rest:
            if rest["quant"] != FP:
                raise UserError(
                    f"{at}: quant must be fp (got {rest['quant']!r})",
                    fix=f"quant: fp keeps the layers in floating point; quantize them with settings ({', '.join(known)})",
                )
            if len(rest) > 1:
                raise UserError(
                    f"{at}: quant: fp takes no settings (got {', '.join(sorted(set(rest) - {'quant'}))})",
                    fix="drop the settings, or drop quant: fp",
                )
            rules.append(LayerRule(match, None, dict(rule)))
            continue
        if not rest:
            raise UserError(f"{at} sets nothing for {match!r}", fix="add quant: fp, or settings such as weight_bits: 8")
        merged = {**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}, **rest}
        rules.append(LayerRule(match, parse_settings(type(settings), merged, at), dict(rule)))
    return tuple(rules)


def _owned(select, owner, index: int):
    return lambda m, fqn: owner(fqn) == index and select(m, fqn)


class PerLayerQuantizer(SourceQuantizer):
    """A ``SourceQuantizer`` whose modules are split among rules (first match wins) and the recipe's default.

    ``rules``: ``(pattern, quantizer or None for fp, description)``, in order; ``default``: the recipe's own
    quantizer, for the modules no rule matches.
    """

    def __init__(self, default: SourceQuantizer, rules: list[tuple[str, SourceQuantizer | None, str]]):
        self.default, self.rules = default, rules
        configs = [
            dataclasses.replace(s, select=_owned(s.select, self.owner, -1), required=False) for s in default.configs
        ]
        for i, (_, quantizer, _) in enumerate(rules):
            for s in quantizer.configs if quantizer else ():
                configs.append(dataclasses.replace(s, select=_owned(s.select, self.owner, i), required=False))
        super().__init__(configs, split_head_input=default.split_head_input)

    def owner(self, name: str) -> int:
        """The index of the first rule whose pattern matches ``name``; -1: the recipe's default."""
        return next((i for i, (pattern, _, _) in enumerate(self.rules) if fnmatchcase(name, pattern)), -1)

    def _candidates(self, model) -> list[str]:
        """Modules that the default or any rule's settings would quantize (ignoring who owns them)."""
        steps = [*self.default.configs, *(s for _, q, _ in self.rules if q for s in q.configs)]
        return [name for name, m in model.named_modules() if any(s.select(m, name) for s in steps)]

    def assignment(self, model) -> dict[str, str]:
        chosen = super().assignment(model)
        return {name: chosen.get(name, FP) for name in self._candidates(model)}

    def check(self, model) -> dict[str, str]:
        """Every rule must take a module it can quantize (``UserError`` naming the rule and some layer names
        otherwise) and something must be quantized; matched modules a rule's settings cannot quantize (e.g. a
        group that does not divide their input size) stay FP, with a warning. Returns the assignment."""
        for step in self.configs:  # the default's and every rule's own checks (zero_points patterns)
            if step.check_model is not None:
                step.check_model(model)
        self.refuse_unfit(model)  # a table the step that owns it cannot split
        candidates = self._candidates(model)
        layers = self.assignment(model)
        for i, (pattern, quantizer, what) in enumerate(self.rules):
            matched = [n for n in candidates if fnmatchcase(n, pattern)]
            taken = [n for n in matched if self.owner(n) == i]
            if not taken:
                shown = ", ".join(candidates[:4]) + (f", ... ({len(candidates)} in all)" if len(candidates) > 4 else "")
                raise UserError(
                    f"recipe layers[{i}] (match {pattern!r}) "
                    + (
                        "takes no layer: earlier rules match all it matches"
                        if matched
                        else "matches no quantizable layer"
                    )
                    + f" of {type(model).__name__}",
                    fix=f"patterns are fnmatch globs on module names: {shown}",
                )
            if quantizer is not None:
                own = {n for n, s in layers.items() if s != FP}
                left = [n for n in taken if n not in own]
                if left:
                    log.warning("recipe layers[%d] (%s) cannot quantize %s: they stay FP", i, what, ", ".join(left))
        if all(s == FP for s in layers.values()):
            raise UserError(
                f"the recipe's layers keep every quantizable layer of {type(model).__name__} in floating point",
                fix="use the FP recipe (xnnpack_fp32), or let some layers quantize",
            )
        self.check_split(model, layers)
        return layers


def per_layer(default: SourceQuantizer, rules: tuple[LayerRule, ...], build) -> PerLayerQuantizer:
    """The per-layer quantizer of a recipe: ``build(settings)`` makes each rule's quantizer."""
    return PerLayerQuantizer(
        default,
        [
            (
                r.match,
                None if r.settings is None else build(r.settings),
                ", ".join(f"{k}: {v}" for k, v in r.raw.items()),
            )
            for r in rules
        ],
    )
