"""Train/eval switches of an exported (PT2E) graph without re-tracing patterns it cannot hold.

An exported graph ignores ``.train()`` / ``.eval()``: torchao's ``move_exported_model_to_train`` / ``_to_eval``
(and ``allow_exported_model_train_eval``, which routes ``.train()`` / ``.eval()`` to them) switch it by rewriting its
dropout and batch-norm ops. Each call traces its patterns anew with ``torch.export`` (8 small exports) and matches them
against the whole graph: 0.5 s per switch on the tests' 2-layer model, 1.1 s on SmolLM2-135M's ``xnnpack_int8_dynamic``
QAT graph (0.02 s here), paid when ``fit`` starts, twice per validation and once per calibration. A graph with no dropout and no batch-norm op has nothing to rewrite:
here its switch does what torchao's does to it (the dead-code pass, the mode recorded in torchao's own attribute),
without the tracing. A graph with either op goes to torchao.

tests/test_upstream_pt2e_modes.py checks that torchao's switch leaves such a graph as this one does (and fails once
torchao rewrites other ops). Retire: when torchao caches its traced patterns or matches only graphs that hold their
ops, delete this module and call torchao's switches (``imports.pt2e()``'s ``move_to_train`` / ``move_to_eval``, and
``allow_exported_model_train_eval`` added there) where this module's are called.

Example::

    graph = allow_train_eval(prepare_qat_pt2e(exported, quantizer))
    graph.eval()     # no dropout or batch norm in it: no re-tracing
"""

from __future__ import annotations

import types

import torch

from qharness.upstream import imports

# torchao's patterns (``_replace_dropout``, ``_replace_batchnorm``) hold these ops; any op whose name contains one of
# them sends the graph to torchao's own switch
_MODE_OPS = ("dropout", "batch_norm")


def has_mode_ops(graph: torch.fx.GraphModule) -> bool:
    """Whether ``graph`` (its own nodes, as torchao matches them) calls an op whose train/eval behaviour torchao's
    switches rewrite."""
    return any(
        node.op == "call_function" and any(name in str(node.target) for name in _MODE_OPS) for node in graph.graph.nodes
    )


def _switch(graph: torch.fx.GraphModule, training: bool) -> torch.fx.GraphModule:
    pt2e = imports.pt2e()
    if getattr(graph, pt2e.TRAINING_ATTR, not training) == training:
        return graph  # already in that mode: torchao returns at once too
    if has_mode_ops(graph):
        return (pt2e.move_to_train if training else pt2e.move_to_eval)(graph)
    setattr(graph, pt2e.TRAINING_ATTR, training)
    if graph.graph.eliminate_dead_code():  # torchao's rewrite runs this pass first
        graph.recompile()
    return graph


def move_to_train(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """torchao's ``move_exported_model_to_train``, without re-tracing when the graph has nothing to rewrite."""
    return _switch(graph, True)


def move_to_eval(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """torchao's ``move_exported_model_to_eval``, without re-tracing when the graph has nothing to rewrite."""
    return _switch(graph, False)


def allow_train_eval(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """torchao's ``allow_exported_model_train_eval``: ``graph.train()`` / ``.eval()`` (also through a parent module's)
    call ``move_to_train`` / ``move_to_eval`` above."""

    def train(self, mode: bool = True):
        _switch(self, mode)
        return self

    def eval(self):
        _switch(self, False)
        return self

    graph.train = types.MethodType(train, graph)  # type: ignore[method-assign]
    graph.eval = types.MethodType(eval, graph)  # type: ignore[method-assign]
    return graph
