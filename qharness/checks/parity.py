"""Scoring and the parity gate: the ``.pte`` against the converted PyTorch model it was lowered from.

Both deploy models are stateful (a static KV cache), called as ``model(tokens[1, n], start) -> logits``:
``logits[1, n, vocab]`` (generic export) or ``logits[1, 1, vocab]`` of the last token (fast path).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qharness.progress import bar
from qharness.sources.example_cache import IGNORE

StepFn = Callable[[torch.Tensor, int], torch.Tensor]


def perplexity(losses_sum: float, count: int, block_losses: list[float] | None = None) -> dict:
    """``loss`` (mean over tokens), ``ppl`` and, when given, ``block_losses`` (mean loss of each block, in block order)."""
    loss = losses_sum / max(count, 1)
    out = {"loss": loss, "ppl": math.exp(min(loss, 50.0))}
    if block_losses is not None:
        out["block_losses"] = block_losses
    return out


def fold_constants(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``graph`` in which everything computed from constants alone (dequantizing the quantized
    weights, mostly) was computed once: the same values, ahead of the calls instead of in every call.

    Converted graphs keep weights quantized and dequantize them on every call; scoring a model that
    returns last-token logits takes one call per token, where that dominates. KV-cache buffers (written
    by mutating ops) are not constants.

    Example::

        ref = fold_constants(deployed)     # ref(tokens, input_pos) == deployed(tokens, input_pos), faster
    """
    import copy
    import operator

    gm = copy.deepcopy(graph)
    mutated = _mutated(gm)

    def pure(node) -> bool:
        if node.op != "call_function":
            return False
        if node.target is operator.getitem:
            return True
        schema = getattr(node.target, "_schema", None)
        return (
            schema is not None and not schema.is_mutable and torch.Tag.nondeterministic_seeded not in node.target.tags
        )

    values: dict[torch.fx.Node, object] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node not in mutated:
            values[node] = _attr(gm, node.target)
        elif pure(node) and node.all_input_nodes and all(a in values for a in node.all_input_nodes):
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: values[a])
            values[node] = node.target(*args, **kwargs)
    for i, node in enumerate(list(gm.graph.nodes)):
        if node.op == "get_attr" or node not in values or not isinstance(values[node], torch.Tensor):
            continue
        if all(u in values for u in node.users):
            continue  # used by constant computations only: those are folded (or dropped) themselves
        name = f"_qharness_folded_{i}"
        gm.register_buffer(name, values[node])
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(name)
        node.replace_all_uses_with(attr, delete_user_cb=lambda u: u not in values)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _mutated(graph: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes ``graph``'s mutating ops write to (KV-cache buffers): state, not constants."""
    mutated = set()
    for node in graph.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and schema.is_mutable:
            for i, arg in enumerate(schema.arguments):
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.fx.Node):
                    mutated.add(value)
    return mutated


class _RoundOtherWay(torch.nn.Module):
    """A float tensor moved by one unit in its last place, up or down at random per element (other tensors as they
    are): the value another order of the same arithmetic could have given. An infinity moves to the largest finite
    value of its sign (a ``-inf`` mask softmaxes to the same zero). The directions are a slice, at a random offset, of
    one seeded buffer of ``+-max`` per dtype: one ``nextafter`` pass per result, no random numbers drawn per element
    (the twin of a 135M model costs about what the model does)."""

    def __init__(self, seed: int):
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)
        self.toward: dict[torch.dtype, torch.Tensor] = {}

    def forward(self, x):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
            return x
        n, buf = x.numel(), self.toward.get(x.dtype)
        if buf is None or buf.numel() < 2 * n:
            up = torch.rand(max(2 * n, 1 << 16), generator=self.generator) < 0.5
            big = torch.tensor(torch.finfo(x.dtype).max, dtype=x.dtype)  # float64's max is no float32 scalar
            buf = self.toward[x.dtype] = torch.where(up, big, -big)
        start = int(torch.randint(buf.numel() - n + 1, (1,), generator=self.generator))
        return torch.nextafter(x, buf[start : start + n].view(x.shape))


def rounding_twin(graph: torch.fx.GraphModule, seed: int = 0) -> torch.fx.GraphModule:
    """``graph`` with the result of every operation moved one unit in the last place, up or down at random: the same
    program up to rounding, sharing ``graph``'s weights and state (its KV cache: call one of them at a time, each from
    its own prefill). How far its outputs move from ``graph``'s is the model's own sensitivity to rounding, the noise
    floor of any kernel that computes the same values in another order: a deep model with dynamic activation
    quantization amplifies it (SmolLM2-135M, 30 layers, 8da4w: logits 0.4 apart on average).

    Example::

        noise = block_logits(step_of(rounding_twin(reference)), tokens) - block_logits(step_of(reference), tokens)
    """
    twin = torch.fx.GraphModule(graph, copy.deepcopy(graph.graph))
    twin.meta.update(graph.meta)  # the deploy record (export path) travels with it
    twin.add_submodule("_qharness_round_other_way", _RoundOtherWay(seed))
    g = twin.graph
    state = _mutated(twin)
    for node in list(g.nodes):
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or node in state or (schema is not None and schema.is_mutable):
            continue
        users = list(node.users)
        with g.inserting_after(node):
            moved = g.call_module("_qharness_round_other_way", (node,))
        for user in users:
            user.replace_input_with(node, moved)
    twin.recompile()
    return twin


def _attr(module, target: str):
    for name in target.split("."):
        module = getattr(module, name)
    return module


def block_logits(step: StepFn, block: torch.Tensor) -> torch.Tensor:
    """``logits[n, vocab]`` of every position of ``block[n]``, leaving the KV cache as a prefill of the
    block at position 0 leaves it. A model that returns the last position only (the fast path) is fed
    the block one token at a time for positions ``0 .. n-2``, then prefilled with it again."""
    logits = step(block[None], 0)[0]
    if logits.shape[0] == block.numel():
        return logits
    rows = [step(block[i : i + 1][None], i)[0, -1] for i in range(block.numel() - 1)]
    return torch.stack([*rows, step(block[None], 0)[0, -1]])


def tail_logits(step: StepFn, block: torch.Tensor, k: int) -> torch.Tensor:
    """``logits[k, vocab]`` of the last ``k`` positions of ``block[n]`` (``block_logits(step, block)[-k:]``): one prefill
    of the first ``n - k + 1`` tokens, then the rest one token at a time (a model that returns every position's
    logits takes the rest in one call). What scoring a continuation needs: its ``k`` tokens, not the context's.

    Example: ``tail_logits(pte, torch.tensor(context + continuation[:-1]), len(continuation))``
    """
    n = block.numel()
    if k >= n:
        return block_logits(step, block)
    k = max(k, 1)
    split = n - k + 1
    head = step(block[None, :split], 0)[0]
    if k == 1:
        return head[-1:]
    if head.shape[0] == split:  # every position's logits (split > 1 here): the rest in one call
        return torch.cat([head[-1:], step(block[None, split:], split)[0]])
    rows = [step(block[i : i + 1][None], i)[0, -1] for i in range(split, n)]
    return torch.cat([head[-1:], torch.stack(rows)])


def _maybe_bar(iterable, desc: str | None, total: int, unit: str):
    return iterable if desc is None else bar(iterable, desc, total=total, unit=unit)


def score_deployed(step: StepFn, x: torch.Tensor, y: torch.Tensor, desc: str | None = None) -> dict:
    """Validation loss/perplexity of a cache model over every position of each block (``block_logits``;
    ``desc``: progress bar), with the mean loss of each block (``block_losses``). Targets of -100 (chat data: prompts,
    example boundaries) are not scored; a block without a scored target has no block loss."""
    total, count, blocks = 0.0, 0, []
    with torch.no_grad():
        for xi, yi in _maybe_bar(zip(x, y), desc, len(x), "block"):
            logits = block_logits(step, xi)
            loss = F.cross_entropy(logits.float(), yi, ignore_index=IGNORE, reduction="sum").item()
            n = int((yi != IGNORE).sum())
            total += loss
            count += n
            if n:
                blocks.append(loss / n)
    return perplexity(total, count, blocks)


def score_jointly(
    ref: StepFn, others: dict[str, StepFn], x: torch.Tensor, y: torch.Tensor, desc: str | None = None
) -> dict[str, dict]:
    """``score_deployed``'s figures of ``ref`` (under ``"reference"``) and of each model of ``others`` (under its
    name), on the same blocks in one pass (``desc``: progress bar), each of ``others`` with ``kl``: its mean KL
    divergence from ``ref`` over every position of the blocks, ``kl_positions``, and ``kl_moved``: the positions
    where it exceeds ``MOVED_KL``. The gate judges a program by
    its KL over these positions as well as its decoding's: a quantized model moves where an int8 activation rounds
    the other way, which on a small model happens at a few positions in a hundred, so a handful of positions can
    show a program such a flip and its rounding twin none. Models sharing a KV cache with ``ref`` (its rounding
    twin) are fine: each block is a prefill from position 0 in each model, one model at a time.

    Example::

        scored = score_jointly(step_of(reference), {"pte": PteModel(path)}, x, y)
        scored["pte"]["kl"]     # nats per position, against the reference
    """
    names = ["reference", *others]
    steps = {"reference": ref, **others}
    totals = {n: [0.0, 0, []] for n in names}  # summed loss, scored targets, block losses
    kl, moved = dict.fromkeys(others, 0.0), dict.fromkeys(others, 0)
    positions = 0
    with torch.no_grad():
        for xi, yi in _maybe_bar(zip(x, y), desc, len(x), "block"):
            logits = {n: block_logits(steps[n], xi) for n in names}
            n_scored = int((yi != IGNORE).sum())
            for n in names:
                loss = F.cross_entropy(logits[n].float(), yi, ignore_index=IGNORE, reduction="sum").item()
                totals[n][0] += loss
                totals[n][1] += n_scored
                if n_scored:
                    totals[n][2].append(loss / n_scored)
            reference = F.log_softmax(logits["reference"].double(), -1)
            for n in others:  # double: a program's KL from its reference can be 1e-13 a position
                each = (reference.exp() * (reference - F.log_softmax(logits[n].double(), -1))).sum(-1)
                kl[n] += each.sum().item()
                moved[n] += int((each > MOVED_KL).sum())
            positions += xi.numel()
    out = {n: perplexity(*totals[n]) for n in names}
    for n in others:
        out[n].update(kl=kl[n] / max(positions, 1), kl_positions=positions, kl_moved=moved[n])
    return out


MOVED_KL = 1e-9  # nats: a position whose KL from its reference exceeds this moved (an int8 activation upstream of it
# rounded the other way); the others sit at float64's ~1e-13


def score_batched(
    forward: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    desc: str | None = None,
) -> dict:
    """Validation loss/perplexity of a no-cache model taking ``[batch_size, seq_len]`` batches (``desc``: progress bar),
    with the mean loss of each block (``block_losses``, the order of ``x``). Targets of -100 are not scored, as in
    ``score_deployed``."""
    total, count, blocks = 0.0, 0, []
    starts = range(0, len(x) - batch_size + 1, batch_size)
    with torch.no_grad():
        for i in _maybe_bar(starts, desc, len(starts), "batch"):
            logits = forward(x[i : i + batch_size])
            yb = y[i : i + batch_size]
            losses = F.cross_entropy(
                logits.flatten(0, 1).float(), yb.flatten(), ignore_index=IGNORE, reduction="none"
            ).view(yb.shape)
            scored = yb != IGNORE
            total += losses.sum().item()
            count += int(scored.sum())
            if scored.all():
                blocks += losses.mean(1).tolist()
            else:
                blocks += [(b[m].mean().item()) for b, m in zip(losses, scored) if m.any()]
    return perplexity(total, count, blocks)


def compare_decoding(
    pte: StepFn,
    ref: StepFn,
    prompts: torch.Tensor,
    decode_steps: int,
    desc: str | None = None,
    tie_margin: float = 0.0,
    twin: StepFn | None = None,
) -> dict:
    """Prefill each prompt in both models, then decode greedily (the ``.pte``'s tokens fed to both).

    Over every prompt position (``block_logits``) and decode step (``desc``: progress bar), returns the
    largest absolute logit difference, how often both pick the same next token (``argmax_agreement``), the
    ``near_ties``: positions where the reference's top-1/top-2 logit gap is at most ``tie_margin`` (an error
    of half the margin can flip them, so they say nothing about drift), ``argmax_agreement_decided``,
    the agreement over the other positions (None when every position is a near tie), and ``kl``: the mean KL
    divergence of the ``.pte``'s next-token distribution from the reference's (nats per position).

    ``twin``: the reference's ``rounding_twin`` (the same program, every result rounded the other way). Then ``noise``
    holds the same figures for the twin against the reference, over the same positions and tokens: how far rounding
    alone moves this model (the gate's noise floor). The twin runs after the reference (they may share a KV cache).
    """
    stats = _Agreement(tie_margin)
    runs = []  # (prompt, the tokens fed, the reference's logits): replayed through the rounding twin
    with torch.no_grad():
        for prompt in _maybe_bar(prompts, desc, len(prompts), "prompt"):
            a, b = block_logits(pte, prompt), block_logits(ref, prompt)
            pos, tokens, seen = prompt.numel(), [], [b]
            for step in range(decode_steps + 1):
                stats.add(a, b)
                if step == decode_steps:
                    break
                token = a[-1].argmax().view(1, 1)
                a, b = pte(token, pos)[0], ref(token, pos)[0]
                tokens.append(token)
                seen.append(b)
                pos += 1
            runs.append((prompt, tokens, seen))
        figures = stats.figures()
        if twin is not None:
            noise = _Agreement(tie_margin)
            for prompt, tokens, seen in runs:
                noise.add(block_logits(twin, prompt), seen[0])
                for pos, (token, b) in enumerate(zip(tokens, seen[1:]), start=prompt.numel()):
                    noise.add(twin(token, pos)[0], b)
            figures["noise"] = noise.figures()
    return figures


def compare_blocks(
    pte: StepFn, ref: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tie_margin: float = 0.0
) -> dict:
    """Every position of the blocks ``x[B, T]``: the ``.pte``'s logits (``block_logits``: prefill from position 0)
    against ``ref(x) -> logits[B, T, vocab]``, a no-cache model such as the trained fake-quant graph (whose input
    shape is fixed: ``x`` is one of its batches). The figures of ``compare_decoding``, without decoding.

    Example::

        figures = compare_blocks(PteModel(path), trained.fake_quant, vx[:batch_size], tie_margin=0.2)
    """
    stats = _Agreement(tie_margin)
    with torch.no_grad():
        b = ref(x)
        for xi, bi in zip(x, b):
            stats.add(block_logits(pte, xi), bi)
    return stats.figures()


class _Agreement:
    """Running figures of two models' logits over positions (rows of ``a`` and ``b``): largest absolute difference,
    argmax agreement, near ties of the reference ``b`` (top-1/top-2 gap at most ``tie_margin``) and the agreement
    over the positions that are not near ties."""

    def __init__(self, tie_margin: float):
        self.tie_margin = tie_margin
        self.max_diff, self.agree, self.total, self.ties, self.agree_decided = 0.0, 0, 0, 0, 0
        self.non_finite, self.kl = 0, 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        diff = (a - b).abs().max().item()
        ref = F.log_softmax(b.double(), -1)  # double: the KL of a program to its reference can be 1e-9
        self.kl += (ref.exp() * (ref - F.log_softmax(a.double(), -1))).sum().item()  # NaN sticks
        self.max_diff = diff if not diff <= self.max_diff else self.max_diff  # NaN sticks (max() would drop it)
        self.non_finite += (~torch.isfinite(a).all(-1) | ~torch.isfinite(b).all(-1)).sum().item()
        same = a.argmax(-1) == b.argmax(-1)
        top2 = b.float().topk(2, dim=-1).values
        tie = top2[:, 0] - top2[:, 1] <= self.tie_margin
        self.agree += same.sum().item()
        self.ties += tie.sum().item()
        self.agree_decided += (same & ~tie).sum().item()
        self.total += a.shape[0]

    def figures(self) -> dict:
        decided = self.total - self.ties
        return {
            "max_abs_diff": self.max_diff,
            "argmax_agreement": self.agree / max(self.total, 1),
            "positions": self.total,
            "tie_margin": self.tie_margin,
            "near_ties": self.ties,
            "argmax_agreement_decided": self.agree_decided / decided if decided else None,
            "non_finite_positions": self.non_finite,
            "kl": self.kl / max(self.total, 1),
        }


def _constant(graph: torch.fx.GraphModule, arg):
    """The tensor a dequantization argument names: a ``get_attr``, or an inner tensor of a torchao weight subclass
    (``access_subclass_inner_tensor(get_attr, "scale")``); None for anything computed."""
    if not isinstance(arg, torch.fx.Node):
        return torch.tensor(arg)
    if arg.op == "get_attr":
        return _attr(graph, arg.target)
    if arg.op == "call_function" and "access_subclass_inner_tensor" in str(arg.target) and arg.args[0].op == "get_attr":
        return getattr(_attr(graph, arg.args[0].target), arg.args[1])
    return None


def learned_scales_carried(graph: torch.fx.GraphModule, qparams: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Whether each trained weight scale is, bit for bit, the scale of a weight dequantization in the converted
    ``graph`` (``weights``: how many trained scales, ``exact``: how many found), in the precision the graph stores it
    (XNNPACK's group-wise scales are bf16). The deployed program is the trained model only if they all are. Reads
    PT2E's ``dequantize_per_*`` and torchao's ``dequantize_affine`` of constant weights.

    Example::

        learned_scales_carried(deployed, trained.weight_qparams)   # {"weights": 15, "exact": 15}
    """
    found = []
    for node in graph.graph.nodes:
        target = str(node.target)
        if node.op != "call_function" or not ("dequantize_per_" in target or "dequantize_affine" in target):
            continue
        scale_arg = node.args[1] if "dequantize_per_" in target else node.args[2]
        if isinstance(node.args[0], torch.fx.Node) and _constant(graph, node.args[0]) is not None:
            scale = _constant(graph, scale_arg)
            if scale is not None:
                found.append(scale)
    exact = sum(
        any(f.numel() == s.numel() and torch.equal(f.reshape(s.shape), s.to(f.dtype)) for f in found)
        for s, _ in qparams.values()
    )
    return {"weights": len(qparams), "exact": exact}


KL_FLOOR = 1e-6  # nats per position: a .pte this close to its reference passes the noise check whatever the noise
# (a mean KL of 1e-6 moves perplexity by about 0.0001%)


# how the reasons that blame the recipe, not the program, begin (``run/pipeline.parity_fix`` reads them)
BREAKS_MODEL, UNSTABLE = "the recipe breaks this model", "the converted model itself is unstable"
UNSTABLE_BELOW = 0.5  # the rounding twin's argmax agreement under which the converted model is too unstable to vouch
# for: rounding alone changes most of its confident next tokens, so any program "agrees" as well as it does (SmolLM2
# with static int8 activations: twin 0.008, the .pte 0.04, perplexity 7.5 -> 6,000,000)


BROKEN_RATIO = 2.0  # the converted model's perplexity over FP's from which a failed gate is first the recipe's doing:
# SmolLM2 with 2-bit or per-channel 3-bit weights, perplexity 7.5 -> 20,000 and more, where rounding alone changes
# 40-50% of the converted model's confident next tokens and the .pte's agreement with it decides little


def recipe_breaks_model(fp_ppl: float, converted_ppl: float, twin_agreement: float | None) -> str | None:
    """The reason a failed gate leads with when the recipe itself breaks the model (the converted model's perplexity
    ``BROKEN_RATIO`` x FP's or more): what the recipe did to the model, which no program of it can undo; None
    otherwise, or where the gate already says so (a twin agreement under ``UNSTABLE_BELOW``)."""
    if not converted_ppl >= BROKEN_RATIO * fp_ppl or (twin_agreement is not None and twin_agreement < UNSTABLE_BELOW):
        return None
    noise = (
        ""
        if twin_agreement is None
        else f"; rounding alone changes {1 - twin_agreement:.0%} of its confident next tokens, so the .pte's "
        "agreement with it decides little"
    )

    def num(x: float) -> str:
        return f"{float(f'{x:.3g}'):,.0f}" if x >= 100 else f"{x:.3g}"

    return (
        f"{BREAKS_MODEL}: its converted model's perplexity is {num(converted_ppl)} against FP's "
        f"{num(fp_ppl)} (x{num(converted_ppl / fp_ppl)}){noise}; use a recipe with more bits, or QAT"
    )


def ppl_noise_bound(reference: list[float], twin: list[float]) -> float:
    """How far rounding alone may move this model's perplexity over these blocks: from the per-block mean losses of the
    reference and of its rounding twin (``rounding_twin``), ``exp(|mean d| + 3 sd(d) / sqrt(n)) - 1`` of their
    differences ``d``: the twin's own perplexity difference, with three standard errors of the blocks' spread."""
    d = [t - r for t, r in zip(twin, reference)]
    if not d:
        return 0.0
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1)) if len(d) > 1 else abs(mean)
    return math.expm1(abs(mean) + 3 * sd / math.sqrt(len(d)))


def required_agreement(figures: dict, min_agree: float, noise: float | None) -> float:
    """The argmax agreement a ``.pte`` must reach over the decided positions of ``figures``: ``min_agree``, or, where
    the reference itself agrees less with its rounding twin (``noise``: that twin's agreement over its decided
    positions; a model that rounding alone moves that far), that agreement less three standard errors."""
    if noise is None:
        return min_agree
    decided = figures["positions"] - figures["near_ties"]
    return min(min_agree, noise - 3 * math.sqrt(noise * (1 - noise) / decided))


def gate(figures: dict, cfg, prefix: str = "", twin_agreement: float | None = None) -> list[str]:
    """The reasons the ``.pte`` fails the gate (empty: it passes); a NaN figure or a non-finite logit fails it.

    Judged: the perplexity difference (against ``max_ppl_rel_diff``, or where rounding alone moves this model's
    perplexity further, ``figures["noise"]["ppl_bound"]``: ``ppl_noise_bound``); the argmax agreement over the positions that are not near ties (with none,
    it compared nothing: perplexity and KL judge alone); with ``figures["noise"]`` (``compare_decoding``'s rounding
    twin) the mean KL divergence against ``parity.max_noise_ratio`` times the reference's own rounding noise
    (or ``KL_FLOOR``), the agreement against what that noise leaves (``required_agreement``), and a reference so
    unstable that its twin keeps under ``UNSTABLE_BELOW`` of its confident tokens fails (nothing can be checked
    against it); ``max_abs_diff`` when set.
    ``prefix``: ``fake_quant_`` judges with ``cfg.fake_quant_max_ppl_rel_diff`` / ``fake_quant_min_argmax_agreement``
    (the ``.pte`` against the trained fake-quant model; no ``max_abs_diff``, no KL), its agreement floor lowered as
    above by ``twin_agreement``, the converted model's rounding twin's (the same model's noise, measured there)."""
    reasons = []
    max_ppl, min_agree = getattr(cfg, prefix + "max_ppl_rel_diff"), getattr(cfg, prefix + "min_argmax_agreement")
    max_abs = None if prefix else cfg.max_abs_diff
    # every comparison is written so that NaN fails it: NaN compares False with everything, NaN with NaN too
    if figures.get("non_finite_positions"):
        reasons.append(
            f"logits are NaN/inf at {figures['non_finite_positions']} of {figures['positions']} compared positions"
        )
    noise = None if prefix else figures.get("noise")
    bound = (noise or {}).get("ppl_bound")
    if not figures["ppl_rel_diff"] <= max(max_ppl, bound or 0.0):
        beyond = "" if bound is None else f" and > {bound:.2%}, what rounding alone moves it (its rounding twin)"
        reasons.append(
            f"perplexity differs by {figures['ppl_rel_diff']:.2%} > parity.{prefix}max_ppl_rel_diff={max_ppl:.2%}"
            + beyond
        )
    if noise is not None:
        allowed = max(cfg.max_noise_ratio * noise["kl"], KL_FLOOR)
        if not figures["kl"] <= allowed:
            reasons.append(
                f"KL divergence from the converted model {figures['kl']:.3g} nats/token > "
                f"parity.max_noise_ratio={cfg.max_noise_ratio:g} x the converted model's own rounding noise "
                f"({noise['kl']:.3g}: its KL from itself with every result rounded the other way)"
            )
    # the rounding twin's agreement: measured here (the main gate) or handed in (the trained-model check)
    twin_agrees = twin_agreement if prefix else (noise or {}).get("argmax_agreement_decided")
    if not prefix and twin_agrees is not None and not twin_agrees >= UNSTABLE_BELOW:
        reasons.append(
            f"{UNSTABLE}: with every result rounded the other way it keeps only "
            f"{twin_agrees:.3f} of its confident next tokens (< {UNSTABLE_BELOW}), so no program of it can be checked "
            "against it; the recipe breaks this model (see its perplexity against FP)"
        )
    decided = figures.get(
        "argmax_agreement_decided", figures["argmax_agreement"]
    )  # no near ties counted: every position
    required = required_agreement(figures, min_agree, twin_agrees)
    if decided is not None and not decided >= required:
        over = ""
        if "near_ties" in figures:
            over = (
                f" over the {figures['positions'] - figures['near_ties']} of {figures['positions']} positions whose "
                f"top-1/top-2 logit gap exceeds parity.tie_margin={figures['tie_margin']}"
            )
        floor = f"parity.{prefix}min_argmax_agreement={min_agree}"
        if required < min_agree:
            floor = (
                f"{required:.3f} ({floor}, less what rounding alone costs this model: its rounding twin agrees "
                f"{twin_agrees:.3f})"
            )
        reasons.append(f"argmax agreement {decided:.3f} < {floor}{over}")
    if max_abs is not None and not figures["max_abs_diff"] <= max_abs:
        reasons.append(f"max abs logit diff {figures['max_abs_diff']:.4g} > parity.max_abs_diff={max_abs}")
    return reasons
