"""qharness/upstream/pt2e_modes.py: train/eval switches of an exported graph leave it as torchao's leave it, without
re-tracing torchao's patterns when the graph holds none of their ops (these tests run torchao's own switches beside
them, so they fail once torchao rewrites other ops)."""

from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch

pytestmark = pytest.mark.fast


def _prepared_tiny_llama():
    from conftest import tiny_spec

    from qharness.recipes.registry import load_recipe
    from qharness.sources.embedded import new_llama
    from qharness.training.prepare import prepare_for_training

    torch.manual_seed(0)
    return prepare_for_training(new_llama(tiny_spec(), 128), load_recipe("xnnpack_int8_dynamic"), 2, 8, True)


def test_torchao_switches_rewrite_only_dropout_and_batch_norm():
    """What ``has_mode_ops`` looks for is all torchao's switches rewrite."""
    from torchao.quantization.pt2e import export_utils

    for switch in (export_utils._move_exported_model_to_train, export_utils._move_exported_model_to_eval):
        assert set(re.findall(r"\b(_replace_\w+)\(", inspect.getsource(switch))) == {
            "_replace_dropout",
            "_replace_batchnorm",
        }


def test_a_graph_without_their_ops_switches_as_torchao_switches_it_without_tracing(monkeypatch):
    from torchao.quantization.pt2e import utils

    from qharness.upstream import imports, pt2e_modes

    ours = _prepared_tiny_llama()
    theirs = copy.deepcopy(ours)
    assert not pt2e_modes.has_mode_ops(ours)
    pt2e = imports.pt2e()
    traced = []
    real = utils._get_aten_graph_module_for_pattern
    monkeypatch.setattr(utils, "_get_aten_graph_module_for_pattern", lambda *a, **k: traced.append(1) or real(*a, **k))
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    for training in (False, True, True, False):
        pt2e_modes.allow_train_eval(ours).train(training)
        n = len(traced)
        (pt2e.move_to_train if training else pt2e.move_to_eval)(theirs)
        assert len(traced) >= n  # torchao's own switch traces (when the mode changes); ours never did
        assert ours.code == theirs.code
        assert getattr(ours, pt2e.TRAINING_ATTR) == getattr(theirs, pt2e.TRAINING_ATTR) == training
        with torch.no_grad():
            assert torch.equal(ours(tokens), theirs(tokens))
    assert traced  # torchao's switch did trace: the comparison above ran against real work
    n = len(traced)
    pt2e_modes.move_to_eval(ours)
    pt2e_modes.move_to_train(ours)
    assert len(traced) == n


def test_a_graph_with_dropout_goes_to_torchao():
    """Dropout exported in training mode: ``.eval()`` turns it off (the same output every call), ``.train()`` on."""
    from qharness.upstream import pt2e_modes

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.5)).train()
    graph = torch.export.export(model, (torch.randn(4, 16),)).module()
    assert pt2e_modes.has_mode_ops(graph)
    graph = pt2e_modes.allow_train_eval(graph)
    x = torch.randn(4, 16)
    graph.eval()
    assert torch.equal(graph(x), graph(x)) and torch.equal(graph(x), model[0](x))
    graph.train()
    assert not torch.equal(graph(x), graph(x))
