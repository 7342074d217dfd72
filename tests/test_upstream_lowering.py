"""Lowering speed-ups (qharness/upstream/lowering/): the same .pte byte for byte, with less upstream work."""

import pytest
import torch

from qharness.upstream import imports, lowering
from qharness.upstream.fixes import xnnpack_scalars
from qharness.upstream.lowering import (
    fake_cache,
    partition_cutting,
    patching,
    provenance,
    xnnpack_packing,
    xnnpack_passes,
)


class _Toy(torch.nn.Module):
    """Linear+ReLU (FuseActivationPass), softmax (ConvertToSDPAPass), a 6-way cat (DecomposeConcatenate)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        h = torch.relu(self.a(x))
        y = torch.softmax(self.b(h), dim=-1)
        return torch.cat([y, y * 2, y + 1, y - 1, y * 3, y.exp()], dim=-1)


def _lower_toy(dynamic_quant: bool, patches=lowering.PATCHES) -> bytes:
    """The toy through lower_to_pte's lowering calls (lowering.export_for_lowering, decompose_for_lowering, ...)."""
    torch.manual_seed(0)
    x = (torch.randn(4, 16),)
    module = _Toy().eval()
    parts = [imports.xnnpack_partitioner(dynamic_quant=False)]
    if dynamic_quant:
        pt2e = imports.pt2e()
        quantizer = xnnpack_scalars.xnnpack_quantizer_cls()().set_global(
            imports.xnnpack_symmetric_config(is_per_channel=True, is_dynamic=True)
        )
        module = pt2e.prepare_pt2e(torch.export.export(module, x).module(), quantizer)
        module(*x)
        module = pt2e.convert_pt2e(module)
        parts = [imports.xnnpack_partitioner(dynamic_quant=True), *parts]
    with lowering.fast_lowering(patches):
        ep = lowering.export_for_lowering(module, x, None)
        ep = lowering.decompose_for_lowering(ep, parts)
        return imports.to_edge_transform_and_lower(ep, partitioner=parts).to_executorch().buffer


class _Toy8da4w(torch.nn.Module):
    """Token ids -> 4-bit table (embedding_4bit after quant fusion) -> two 8da4w linears (torchao primitives)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, tokens):
        h = self.emb(tokens)
        return self.b(torch.relu(self.a(h))) + h


def _lower_toy_8da4w(patches=lowering.PATCHES) -> bytes:
    """The xnnpack_8da4w recipe's program of a toy with a dynamic sequence length, as lower_program lowers it."""
    from qharness.deploy.lower import executorch_config
    from qharness.recipes.registry import load_recipe

    torch.manual_seed(0)
    recipe = load_recipe("xnnpack_8da4w")
    module = _Toy8da4w().eval().requires_grad_(False)
    recipe.make_quantizer(is_qat=False).convert(module)
    x, dynamic = (torch.randint(0, 64, (1, 8)),), ({1: torch.export.Dim("n", min=1, max=16)},)
    with torch.no_grad():
        module = torch.export.export(module, x, dynamic_shapes=dynamic, strict=False).module()
    parts = recipe.make_partitioners()
    with lowering.fast_lowering(patches):
        ep = lowering.export_for_lowering(module, x, dynamic)
        ep = lowering.decompose_for_lowering(ep, parts)
        edge = imports.to_edge_transform_and_lower(ep, partitioner=parts)
        return edge.to_executorch(imports.executorch_backend_config(**executorch_config(recipe))).buffer


_TOYS = {"pt2e": lambda patches: _lower_toy(dynamic_quant=True, patches=patches), "8da4w": _lower_toy_8da4w}


@pytest.fixture(scope="module")
def upstream_ptes():
    """Each toy as upstream lowers it: both XNNPACK partitioners, float and quantized partitions (pt2e); torchao's
    primitives, a 4-bit table and symbolic shapes (8da4w)."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("QHARNESS_UPSTREAM_LOWERING", "1")
        return {name: lower(lowering.PATCHES) for name, lower in _TOYS.items()}


@pytest.mark.parametrize("toy", sorted(_TOYS))
def test_fast_lowering_writes_the_same_pte(upstream_ptes, toy):
    assert _TOYS[toy](lowering.PATCHES) == upstream_ptes[toy]


@pytest.mark.slow  # ~90 s: which patch broke; all patches together run in the default suite above
@pytest.mark.parametrize("toy", sorted(_TOYS))
@pytest.mark.parametrize("patch", lowering.PATCHES, ids=lambda p: p.__name__.rsplit(".", 1)[-1])
def test_each_patch_alone_writes_the_same_pte(upstream_ptes, patch, toy):
    """One module per patch: each alone leaves the program as upstream writes it."""
    assert _TOYS[toy]((patch,)) == upstream_ptes[toy]


def test_delegation_progress_counts_each_backends_partitions():
    """lowering.delegation_progress: one progress object per backend hand-off, moved once per preprocessed partition,
    closed; the program is the same."""
    started = []

    class Progress:
        def __init__(self, backend, partitions):
            self.backend, self.partitions, self.done, self.closed = backend, partitions, 0, False
            started.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            self.closed = True

    plain = _lower_toy(dynamic_quant=True)
    with lowering.delegation_progress(Progress):
        assert _lower_toy(dynamic_quant=True) == plain
    assert [p.backend for p in started] == ["XnnpackBackend", "XnnpackBackend"]  # one per partitioner
    assert all(p.partitions > 0 and p.done == p.partitions and p.closed for p in started)


def _count_calls(monkeypatch, owner, name, when=lambda *args: True):
    calls = []
    upstream = getattr(owner, name)

    def counted(*args, **kwargs):
        if when(*args):
            calls.append(1)
        return upstream(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.slow  # ~25 s, counts the work each way; byte identity alone runs in the default suite above
def test_fast_lowering_writes_the_same_pte_with_less_work(monkeypatch):
    """Each workaround in lowering.fast_lowering leaves the .pte byte for byte the same and still saves work;
    when a count below stops differing, upstream removed that cost: drop the workaround."""
    from torch.export import ExportedProgram
    from torch.fx.passes.infra.pass_base import PassBase

    counts = {}
    for upstream in (True, False):
        monkeypatch.setenv("QHARNESS_UPSTREAM_LOWERING", "1" if upstream else "0")
        with monkeypatch.context() as m:
            c = {
                "decompositions": _count_calls(m, ExportedProgram, "run_decompositions"),
                "node copies": _count_calls(m, torch.fx.Graph, "node_copy"),
                "xnnpack passes": _count_calls(
                    m, PassBase, "__call__", lambda p, *_: type(p).__module__.startswith("executorch.backends")
                ),
            }
            pte = _lower_toy(dynamic_quant=True)  # both XNNPACK partitioners, float and quantized partitions
        counts[upstream] = ({k: len(v) for k, v in c.items()}, pte)
    assert counts[True][1] == counts[False][1]
    for key, n in counts[False][0].items():
        assert n < counts[True][0][key], (key, counts)


@pytest.mark.fast
def test_upstream_node_source_still_deep_copies_provenance():
    """torch.fx.traceback.NodeSource copies the whole from_node chain; provenance.patch shares it (same content)."""
    from torch.fx.traceback import NodeSource

    g = torch.fx.Graph()
    node = g.placeholder("x")
    node.meta["from_node"] = [NodeSource(None, "export")]
    assert NodeSource(node, "pass").from_node[0] is not node.meta["from_node"][0]
    with provenance.patch():
        shared = NodeSource(node, "pass")
    assert shared.from_node[0] is node.meta["from_node"][0]
    assert shared.to_dict() == NodeSource(node, "pass").to_dict()


@pytest.mark.fast
def test_xnnpack_pass_list_is_the_one_the_skip_table_was_read_from():
    """xnnpack_passes.pass_triggers was read from these passes (ExecuTorch 1.5.1); re-read them when this fails."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager

    names = [p.__name__ for p in XNNPACKPassManager(None).passes]
    assert names == [
        "XNNPACKRemoveCloneOpsTransform",
        "DimOrderOpsRevertPass",
        "ConvertToUpsampleBilinear2d",
        "ConvertToLinearPass",
        "PropagateCustomMetaPass",
        "ConvertToSDPAPass",
        "ConstPropPass",
        "FuseBatchNormPass",
        "DecomposeBatchNorm",
        "FuseActivationPass",
        "DecomposeConcatenate",
        "RemoveGetItemPass",
        "InsertPadQDQPass",
        "Conv1dUnsqueezePass",
        "PReLUReshapePass",
        "ChannelsLastTaggedReshapePass",
        "RemoveRedundantCopyPass",
    ]
    assert set(xnnpack_passes.pass_triggers()) <= set(names)


@pytest.mark.fast
def test_xnnpack_pattern_passes_need_their_trigger_ops():
    """ConvertToSDPAPass / ConvertToUpsampleBilinear2d only match subgraphs holding every op of one of their
    patterns: a partition without the listed ops holds no pattern."""
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa

    triggers = xnnpack_passes.pass_triggers()
    for pass_name, patterns in (
        ("ConvertToSDPAPass", sdpa.get_graphs()),
        ("ConvertToUpsampleBilinear2d", bilinear_2d.get_graphs()),
    ):
        for pattern in patterns:
            assert triggers[pass_name](patching.called_ops(pattern)), pass_name


@pytest.mark.fast
def test_legalize_in_place_matches_upstream_legalize():
    """Same node order, names, users order and name space as torch's legalize_graph, on disordered graphs."""
    import copy
    import random

    from torch.fx.passes.tools_common import legalize_graph

    class M(torch.nn.Module):
        def forward(self, x, y):
            a = x + y
            b = torch.relu(a * 2) + x.shape[0]
            return b.sum(0), torch.cat([a, b, a * b]) * a.shape[0]

    n = torch.export.Dim("n")
    gm = torch.export.export(M(), (torch.randn(3, 4), torch.randn(3, 4)), dynamic_shapes=({0: n}, {0: n})).module()

    def state(g):
        return [(node.name, [u.name for u in node.users]) for node in g.graph.nodes]

    rng = random.Random(0)
    for _ in range(10):
        ours, theirs = copy.deepcopy(gm), copy.deepcopy(gm)
        names = [node.name for node in gm.graph.nodes if node.op not in ("placeholder", "output")]
        moves = [rng.sample(names, 2) for _ in range(5)]
        for g in (ours, theirs):
            by_name = {node.name: node for node in g.graph.nodes}
            for a, b in moves:
                by_name[b].append(by_name[a])  # out of topological order
        legalize_graph(theirs)
        partition_cutting.legalize_graph_in_place(ours)
        assert state(ours) == state(theirs)
        for attr in ("_used_names", "_base_count"):
            assert getattr(ours.graph._graph_namespace, attr) == getattr(theirs.graph._graph_namespace, attr)
        assert [n.name for n in ours.graph._graph_namespace._obj_to_name] == [
            n.name for n in theirs.graph._graph_namespace._obj_to_name
        ]
        assert (
            partition_cutting._namespace_by_create_name(list(ours.graph.nodes))._base_count
            == ours.graph._graph_namespace._base_count
        )
        new = [
            g.graph.create_node("call_function", torch.ops.aten.neg.default, (next(iter(g.graph.nodes)),))
            for g in (ours, theirs)
        ]
        assert new[0].name == new[1].name  # the name space is the same
        for g, node in zip((ours, theirs), new):
            g.graph.erase_node(node)
            g.recompile()
        assert ours.code == theirs.code
        x, y = torch.randn(5, 4), torch.randn(5, 4)
        torch.testing.assert_close(ours(x, y), theirs(x, y))


@pytest.mark.fast
def test_fake_cache_serves_torchao_primitives_as_upstream_computes_them(monkeypatch):
    """torchao's primitives are CompositeImplicitAutograd and refused by the fake-tensor cache ("non-builtin"):
    fake_cache.patch dispatches them below autograd into the cache. Same outputs (shapes, strides, dtypes, symbolic
    sizes), and the second call with the same metadata is a cache hit; when this fails, upstream changed either."""
    import torchao.quantization.quant_primitives  # noqa: F401  registers torch.ops.torchao
    from torch._subclasses.fake_tensor import FakeTensorMode, _BypassDispatchCache
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    ops = fake_cache.torchao_ops()
    assert [op.name() for op in ops] == [f"torchao::{name}" for name in fake_cache.PRIMITIVES]
    for op in ops:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), torch._C.DispatchKey.CompositeImplicitAutograd)
        with pytest.raises(_BypassDispatchCache, match="non-builtin"):
            FakeTensorMode()._validate_cache_key(op, (), {})

    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    def run(mode):
        dims = [DimDynamic.STATIC, DimDynamic.DYNAMIC, DimDynamic.STATIC]  # tokens [1, n, dim]: n symbolic
        x = mode.from_tensor(torch.randn(1, 6, 64), symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))
        w = mode.from_tensor(torch.randint(-8, 8, (32, 64), dtype=torch.int8))
        ws = mode.from_tensor(torch.rand(32, 2))
        out = []
        for _ in range(2):
            choose, quantize, dequantize = ops  # graph nodes call the overloads
            scale, zero = choose(x, "ASYMMETRIC", [1, 1, 64], torch.int8, -128, 127)
            q = quantize(x, [1, 1, 64], scale, zero, torch.int8, -128, 127)
            d = dequantize(w, [1, 32], ws, None, torch.int8, -8, 7)
            y = torch.ops.aten.linear.default(q.float(), d)
            out.append([(str(t.shape), str(t.stride()), t.dtype) for t in (scale, zero, q, d, y)])
        return out

    computed = []  # primitives FakeTensorMode computed (ran their bodies) itself: cache misses
    upstream_dispatch = FakeTensorMode._dispatch_impl

    def dispatch_impl(self, func, *args):
        computed.append(func)
        return upstream_dispatch(self, func, *args)

    monkeypatch.setattr(FakeTensorMode, "_dispatch_impl", dispatch_impl)
    upstream = run(FakeTensorMode(shape_env=ShapeEnv()))
    assert not set(computed) & set(ops)  # decomposed before the fake mode sees them: every call runs the body
    computed.clear()
    with fake_cache.patch():
        ours = run(FakeTensorMode(shape_env=ShapeEnv()))
    assert ours == upstream
    assert "s" in upstream[0][0][0]  # a symbolic size: [1, s.., 1]
    assert [f for f in computed if f in ops] == list(ops)  # each body once; the second call a cache hit


@pytest.mark.fast
def test_int4_packing_is_upstreams():
    """xnnpack_packing.pack_int4 writes NodeVisitor.convert_to_qc4w's bytes: even and odd widths, extremes, a
    squeezable 3-D weight, a non-contiguous one, a Parameter."""
    from executorch.backends.xnnpack.operators.node_visitor import NodeVisitor

    g = torch.Generator().manual_seed(0)
    weights = [torch.randint(-8, 8, shape, dtype=torch.int8, generator=g) for shape in ((7, 32), (5, 33), (1, 6, 9))]
    weights += [torch.tensor([[-8, 7, 0], [7, -8, -1]], dtype=torch.int8), weights[0].t()]
    weights.append(torch.nn.Parameter(weights[1].clone(), requires_grad=False))
    for w in weights:
        ours, theirs = xnnpack_packing.pack_int4(w), NodeVisitor.convert_to_qc4w(w)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape and torch.equal(ours, theirs)
        assert ours.untyped_storage().nbytes() == theirs.untyped_storage().nbytes()
    with pytest.raises(AssertionError, match="out of"):
        xnnpack_packing.pack_int4(torch.tensor([[8, 0]], dtype=torch.int8))
