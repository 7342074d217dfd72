"""Every import that moves between releases of torchao / ExecuTorch / transformers lives here.

When upstream moves a symbol, this is the one file to edit. Each workaround names the upstream
issue it works around and has a test (tests/test_compat.py) that fails once upstream changes.

Imports are done inside functions: ``import executorch`` and the quantizers take seconds.
"""

from __future__ import annotations

import contextlib
import copy
import os
import types

import torch


# --- PT2E (torchao.quantization.pt2e; torch.ao.quantization was the old home) -------------------
def pt2e():
    """The PT2E entry points as a namespace: prepare_pt2e, prepare_qat_pt2e, convert_pt2e, ..."""
    import types

    from torchao.quantization import pt2e as _pt2e
    from torchao.quantization.pt2e import quantize_pt2e

    return types.SimpleNamespace(
        prepare_pt2e=quantize_pt2e.prepare_pt2e,
        prepare_qat_pt2e=quantize_pt2e.prepare_qat_pt2e,
        convert_pt2e=quantize_pt2e.convert_pt2e,
        move_to_train=_pt2e.move_exported_model_to_train,
        move_to_eval=_pt2e.move_exported_model_to_eval,
        allow_train_eval=_pt2e.allow_exported_model_train_eval,
        FakeQuantize=_pt2e.FakeQuantize,
        FakeQuantizeBase=_pt2e.FakeQuantizeBase,
        MovingAverageMinMaxObserver=_pt2e.MovingAverageMinMaxObserver,
        MinMaxObserver=_pt2e.MinMaxObserver,
        HistogramObserver=_pt2e.HistogramObserver,
        MovingAveragePerChannelMinMaxObserver=_pt2e.MovingAveragePerChannelMinMaxObserver,
    )


# --- XNNPACK quantizer ----------------------------------------------------------------------------
def _lift_scalars_keeping_dtype(model: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Lift scalar operands of aten.add/mul into buffers of the node's own dtype.

    ExecuTorch 1.5.1's ``_convert_scalars_to_attrs`` lifts them as float32, which turns HF Llama's
    int64 ``arange(n) + 0`` into a float index ("tensors used as indices must be long ...").
    Upstream: pytorch/executorch issue #22062, fixed by PR #22065 (after 1.5.1).
    """
    from torchao.quantization.pt2e.utils import get_new_attr_name_with_prefix

    for node in model.graph.nodes:
        if node.op != "call_function" or node.target not in (torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor):
            continue
        new_args = []
        for arg in node.args:
            if isinstance(arg, torch.fx.Node):
                new_args.append(arg)
                continue
            name = get_new_attr_name_with_prefix("_tensor_constant_")(model)
            value = torch.tensor(arg, dtype=node.meta["val"].dtype)
            model.register_buffer(name, value)
            with model.graph.inserting_before(node):
                get_attr = model.graph.create_node("get_attr", name, (), {})
                get_attr.meta["val"] = node.meta["val"].fake_mode.from_tensor(value, static_shapes=True)
            new_args.append(get_attr)
        node.args = tuple(new_args)
    model.recompile()
    return model


def xnnpack_quantizer_cls():
    """``XNNPACKQuantizer`` with the scalar-lifting fix applied (see ``_lift_scalars_keeping_dtype``)."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer

    class FixedXNNPACKQuantizer(XNNPACKQuantizer):
        def transform_for_annotation(self, model):
            return _lift_scalars_keeping_dtype(model)

    return FixedXNNPACKQuantizer


def vulkan_quantizer_cls():
    """``VulkanQuantizer`` that leaves scalar operands in place.

    Upstream's ``transform_for_annotation`` lifts every add/mul scalar into a buffer (same code as the
    XNNPACK bug above); the Vulkan backend's RMSNorm fusion then reads ``eps`` from a fake tensor and
    fails ("Could not guard on data-dependent expression", vulkan/patterns/rms_norm.py). Weight-only
    recipes annotate no add/mul, so nothing needs lifting.
    """
    from executorch.backends.vulkan.quantizer.vulkan_quantizer import VulkanQuantizer

    class NoLiftVulkanQuantizer(VulkanQuantizer):
        def transform_for_annotation(self, model):
            return model

    return NoLiftVulkanQuantizer


def vulkan_partitioner():
    """``VulkanPartitioner`` that leaves buffer writes whose value only feeds the program output (HF's
    static-cache ``cumulative_length`` counters) outside the delegate: upstream tags them into a
    partition and serialization then fails ("Buffer output getitem does not point to a buffer")."""
    from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner

    class BufferSafeVulkanPartitioner(VulkanPartitioner):
        def partition(self, exported_program):
            result = super().partition(exported_program)
            sig = exported_program.graph_signature
            buffer_of_input = {v: k for k, v in sig.inputs_to_buffers.items()}
            untag = set()
            for node in exported_program.graph.nodes:
                buffer = sig.buffers_to_mutate.get(node.name)
                if buffer and all(u.op == "output" for u in node.users) and "delegation_tag" in node.meta:
                    node.meta.pop("delegation_tag")
                    untag.add(buffer_of_input.get(buffer))
            for node in exported_program.graph.nodes:
                if node.op == "placeholder" and node.name in untag:
                    node.meta.pop("delegation_tag", None)
            return result

    return BufferSafeVulkanPartitioner()


def xnnpack_symmetric_config(**kwargs):
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import get_symmetric_quantization_config

    return get_symmetric_quantization_config(**kwargs)


def upstream_xnnpack_scalar_lifting():
    """The unpatched upstream function, for the test that tells when the workaround can go."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer_utils import _convert_scalars_to_attrs

    return _convert_scalars_to_attrs


# --- Partitioners ---------------------------------------------------------------------------------
def xnnpack_partitioner(dynamic_quant: bool):
    """An XNNPACK partitioner. Dynamically quantized graphs need the dynamic-quant partitioner placed
    before the plain one, or lowering fails with "Invalid partition, found dependency cycles"."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackDynamicallyQuantizedPartitioner,
        XnnpackPartitioner,
    )

    return XnnpackDynamicallyQuantizedPartitioner() if dynamic_quant else XnnpackPartitioner()


# --- Lowering speed -------------------------------------------------------------------------------
# Lowering a 2-layer HF Llama took 25-150 s here, a 30-layer one 10+ minutes. Profiles (cProfile, py-spy)
# put the time in upstream work that changes nothing; each workaround below names its upstream cause.
# With all of them the .pte is byte for byte the same (scripts/lower_speed.py and the slow test in
# tests/test_compat.py compare). QHARNESS_UPSTREAM_LOWERING=1 turns them all off.
def _shallow_node_provenance():
    """torch.fx.traceback.NodeSource.__init__ deep-copies the node's whole provenance chain
    (``meta["from_node"]``) each time a pass re-creates a node. Every retrace adds a level, and
    lowering runs hundreds of retraces (run_decompositions, edge passes, 17 XNNPACK passes per
    partition), so the copies grow quadratically (a third of lowering time). The chain is read-only
    history (debug handles come from its oldest entry); sharing it gives the same result."""
    from torch.fx import traceback as fx_traceback

    cls = fx_traceback.NodeSource
    upstream_init = cls.__init__

    def init(self, node, pass_name="", action=None):
        upstream_init(self, None, pass_name, action)
        if node:
            self.node_info = self.NodeInfo(name=node.name, target=str(node.target), graph_id=id(node.graph))
            self.from_node = list(node.meta.get("from_node", ()))

    return _patched(cls, "__init__", init)


def _aten(op):
    """An Edge op's ATen overload (an ``EdgeOpOverload`` wraps it in ``_op``); anything else as is."""
    return op if isinstance(op, torch._ops.OpOverload) else getattr(op, "_op", op)


def _skip_noop_decompositions():
    """``to_edge_transform_and_lower`` runs ``run_decompositions`` twice per partitioner (ExecuTorch's
    EDGE_DO_NOT_DECOMP path), plus once to functionalize, each a full re-trace of the program even when
    nothing in the graph is left to decompose. A program that already came out of ``run_decompositions``
    (functional ATen) and uses no op of the table is returned as is; upstream does the same check on its
    other path (``contains_any_call_fn_target_op`` in ``_gen_edge_manager_for_partitioners``)."""
    import weakref

    from torch.export import ExportedProgram

    upstream = ExportedProgram.run_decompositions
    decomposed = weakref.WeakSet()

    def run_decompositions(self, decomp_table=None, decompose_custom_triton_ops=False):
        if self in decomposed and decomp_table is not None and not decompose_custom_triton_ops:
            # sym_size.int is in the table (a CompositeImplicitAutograd op) but traces back to itself
            if not (_called_ops(self.graph_module) & (set(dict(decomp_table)) - {torch.ops.aten.sym_size.int})):
                return self
        out = upstream(self, decomp_table, decompose_custom_triton_ops)
        decomposed.add(out)
        return out

    return _patched(ExportedProgram, "run_decompositions", run_decompositions)


# Ops every subgraph pattern of ConvertToSDPAPass holds (backends/xnnpack/partition/graphs/sdpa.py; the
# matcher maps each pattern op onto a graph node with the same target, so a partition lacking one of
# them cannot match). tests/test_compat.py checks them against the patterns.
_SDPA_PATTERN_OPS = (
    "aten._softmax.default", "aten.add.Tensor", "aten.any.dim", "aten.bmm.default", "aten.eq.Scalar",
    "aten.expand_copy.default", "aten.full_like.default", "aten.logical_not.default", "aten.mul.Scalar",
    "aten.permute_copy.default", "aten.view_copy.default", "aten.where.self", "dim_order_ops._clone_dim_order.default",
)


def _op(name: str):
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _xnnpack_pass_triggers() -> dict:
    """XNNPACK preprocess pass -> ``applies(ops)``: whether it can act on a partition calling ``ops``
    (ATen overloads). Otherwise the pass would only re-trace the partition. Read from ExecuTorch 1.5.1's
    ``backends/xnnpack/_passes``; tests/test_compat.py checks the pass list and the patterns. Passes not
    named here always run."""
    from executorch.backends.xnnpack._passes.convert_to_linear import ConvertToLinearPass
    from executorch.backends.xnnpack._passes.decompose_batch_norm import DecomposeBatchNorm
    from executorch.backends.xnnpack._passes.fuse_activation_pass import FuseActivationPass
    from executorch.exir.passes.memory_format_ops_pass import MemoryFormatOpsMap

    def any_of(*ops):
        wanted = {_aten(op) for op in ops}
        return lambda present: bool(wanted & present)

    aten = torch.ops.aten
    batch_norm = any_of(*DecomposeBatchNorm.BATCH_NORM_OPS)
    sdpa = {_op(name) for name in _SDPA_PATTERN_OPS}
    return {
        "DimOrderOpsRevertPass": any_of(*MemoryFormatOpsMap),
        "ConvertToUpsampleBilinear2d": any_of(aten.upsample_bilinear2d.vec),  # its patterns are this one op
        "ConvertToLinearPass": any_of(*ConvertToLinearPass.targets),  # [add]mm / bmm from a linear
        "ConvertToSDPAPass": lambda present: sdpa <= present,
        "FuseBatchNormPass": batch_norm,
        "DecomposeBatchNorm": batch_norm,
        "FuseActivationPass": any_of(*FuseActivationPass.FUSEABLE_ACTIVATIONS),
        "DecomposeConcatenate": any_of(aten.cat.default),
        "RemoveGetItemPass": any_of(aten.max_pool2d_with_indices.default, aten.max.dim),
        "InsertPadQDQPass": any_of(aten.constant_pad_nd.default),
        "Conv1dUnsqueezePass": any_of(aten.convolution.default),
        "PReLUReshapePass": any_of(aten._prelu_kernel.default),
        "RemoveRedundantCopyPass": any_of(aten._to_copy.default),
    }


def _called_ops(gm: torch.fx.GraphModule) -> set:
    """ATen overloads ``gm`` (and its control-flow subgraphs) call; Edge ops count as their ATen op."""
    from executorch.exir.graph_module import get_control_flow_submodules

    ops, queue = set(), [gm]
    while queue:
        g = queue.pop()
        ops.update(_aten(n.target) for n in g.graph.nodes if n.op == "call_function")
        queue.extend(sub for _, sub, _ in get_control_flow_submodules(g))
    return ops


def _skip_inapplicable_xnnpack_passes():
    """``XnnpackBackend.preprocess`` runs 17 passes on every partition, each a full fake-tensor re-trace
    (an HF Llama layer splits into ~12 partitions: 200 re-traces per layer). Passes that cannot act on
    the partition are skipped (``_xnnpack_pass_triggers``); ``PropagateCustomMetaPass`` runs only when a
    node carries ``meta["custom"]``, the one thing it copies. The rest run as upstream runs them
    (``XNNPACKPassManager.transform``)."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager, XNNPACKPass
    from executorch.exir.pass_base import ExportPass
    from executorch.exir.program._program import _transform

    triggers = _xnnpack_pass_triggers()

    def applies(pass_, gm) -> bool:
        if pass_.__name__ == "PropagateCustomMetaPass":
            return any("custom" in n.meta for n in gm.graph.nodes)
        trigger = triggers.get(pass_.__name__)
        return trigger is None or trigger(_called_ops(gm))

    def transform(self):
        ep = self.exported_program
        for pass_ in self.passes:
            if not applies(pass_, ep.graph_module):
                continue
            if issubclass(pass_, XNNPACKPass):
                ep = _transform(ep, pass_(ep))
            elif issubclass(pass_, ExportPass):
                ep = _transform(ep, pass_())
            else:
                raise RuntimeError(f"Expecting ExportPass or ExportPass(), but got pass: {pass_} with type: {type(pass_)}")
        return ep

    return _patched(XNNPACKPassManager, "transform", transform)


# torch/fx/passes/tools_common.py legalize_graph's PRIORITIZED_OPS (torch 2.13)
_LEGALIZE_FIRST = None


def legalize_graph_in_place(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``torch.fx.passes.tools_common.legalize_graph`` without copying the graph or recompiling.

    Upstream topologically sorts with Kahn's algorithm into a new graph (``node_copy`` of every node)
    and sets it on ``gm`` (a recompile). This computes the same order with the same queue rules, then
    relinks the nodes and rebuilds what the copy would have rebuilt (users in creation order, the name
    space, the find-nodes table), so the graph is indistinguishable from upstream's result.
    ``gm``'s generated code is left stale: recompile before running it.
    """
    import collections
    import operator

    from torch.fx.graph import _FindNodesLookupTable

    global _LEGALIZE_FIRST
    if _LEGALIZE_FIRST is None:
        _LEGALIZE_FIRST = (operator.add, operator.mul, operator.sub, operator.floordiv, operator.truediv, operator.mod,
                           operator.le, operator.lt, operator.ge, operator.gt, operator.eq, operator.ne,
                           torch.ops.aten.sym_constrain_range.default, torch.ops.aten.sym_constrain_range_for_size.default,
                           torch.ops.aten._assert_async.msg, torch.ops.aten.scalar_tensor.default, torch.ops.aten._assert_scalar.default)
    graph = gm.graph
    nodes = list(graph.nodes)
    indeg = dict.fromkeys(nodes, 0)
    for node in nodes:
        for user in node.users:
            indeg[user] += 1
    queue = collections.deque(n for n in nodes if indeg[n] == 0)
    order = []
    while queue:
        cur = queue.popleft()
        order.append(cur)
        for user in cur.users:
            indeg[user] -= 1
            if indeg[user] == 0:
                if user.op == "call_function" and user.target in _LEGALIZE_FIRST:
                    queue.appendleft(user)
                else:
                    queue.append(user)
    if len(order) < len(nodes):
        from torch.fx.passes.tools_common import legalize_graph

        return legalize_graph(gm)  # raises upstream's cycle error
    position = {n: i for i, n in enumerate(order)}
    table, metas = _FindNodesLookupTable(), set()
    for n in order:
        graph._root._prepend(n)  # moves n to the end
        users = n.users
        if len(users) > 1:  # the copy registers users as it creates them: in the new order
            keys = list(users)
            ordered = sorted(keys, key=position.__getitem__)
            if ordered != keys:
                users.clear()
                users.update(dict.fromkeys(ordered))
        table.insert(n)
        if id(n.meta) in metas:  # the copy gives each node its own meta dict
            n.meta = copy.copy(n.meta)
        metas.add(id(n.meta))
    graph._graph_namespace, graph._find_nodes_lookup_table = _namespace_of(order), table
    graph._tracer_cls = graph._tracer_extras = None
    graph._co_fields = {}
    return gm


_NAME_PARTS: dict = {}


def _namespace_of(nodes: list):
    """The ``torch.fx.graph._Namespace`` a new graph has after ``create_node(name=n.name)`` for each of
    ``nodes`` in order (names already unique and legal): every name used, per base name the count
    ``create_name`` leaves (the suffix of the last ``base_N``, else what it was)."""
    from torch.fx.graph import _illegal_names, _name_regex, _Namespace

    namespace = _Namespace()
    used, counts = namespace._used_names, namespace._base_count
    for n in nodes:
        name = n.name
        parts = _NAME_PARTS.get(name)
        if parts is None:
            match = _name_regex.match(name)
            if match is None or name in _illegal_names:
                return _namespace_by_create_name(nodes)
            base, num = match.group(1, 2)
            parts = _NAME_PARTS[name] = (base, None if num is None else int(num))
        base, num = parts
        if name in used:
            return _namespace_by_create_name(nodes)
        counts[base] = counts.get(base, 0) if num is None else num
        used.add(name)
        namespace._obj_to_name[n] = name
    return namespace


def _namespace_by_create_name(nodes: list):
    from torch.fx.graph import _Namespace

    namespace = _Namespace()
    for n in nodes:
        if namespace.create_name(n.name, None) != n.name:
            raise AssertionError(f"node name {n.name} is not reproducible")
        namespace.associate_name_with_obj(n.name, n)
    return namespace


def _one_recompile_per_partitioning():
    """ExecuTorch's ``create_submodule_from_nodes`` re-sorts the whole program graph after cutting out
    each partition (``legalize_graph``: a copy of every node, then the whole program's Python code is
    regenerated and compiled): O(partitions x nodes), the largest cost of lowering a 30-layer model.
    The sort is done in place (``legalize_graph_in_place``), the code regenerated once, after the last
    partition (``_create_partitions_in_graph_module``). Nothing runs the program in between."""
    import executorch.exir.backend.backend_api as backend_api
    import executorch.exir.lowered_backend_module as lbm

    upstream_create = backend_api._create_partitions_in_graph_module

    def create_partitions_in_graph_module(tagged_graph_module, *args, **kwargs):
        out = upstream_create(tagged_graph_module, *args, **kwargs)
        tagged_graph_module.recompile()
        return out

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(lbm, "legalize_graph", legalize_graph_in_place))
    stack.enter_context(_patched(backend_api, "_create_partitions_in_graph_module", create_partitions_in_graph_module))
    return stack


def _skip_inapplicable_edge_passes():
    """``to_edge``'s ATen-to-Edge passes re-trace the whole program each; two of them only rewrite ops
    the program may not have: ``NormalizeTransposePass`` (``aten.t``) and
    ``ReplaceBrokenOpsWithFunctionalOpsPass`` (view ops, which ``ReplaceViewOpsWithViewCopyOpsPass``
    has already replaced). Without those ops they are skipped (exir/passes/normalize_transpose_pass.py,
    replace_broken_ops_with_function_ops_pass.py)."""
    from executorch.exir.pass_base import PassResult
    from executorch.exir.passes.normalize_transpose_pass import NormalizeTransposePass
    from executorch.exir.passes.replace_broken_ops_with_function_ops_pass import ReplaceBrokenOpsWithFunctionalOpsPass

    def only_if(cls, applies):
        upstream = cls.call

        def call(self, graph_module):
            if not applies(_called_ops(graph_module)):
                return PassResult(graph_module, False)
            return upstream(self, graph_module)

        return _patched(cls, "call", call)

    stack = contextlib.ExitStack()
    stack.enter_context(only_if(NormalizeTransposePass, lambda ops: torch.ops.aten.t.default in ops))
    stack.enter_context(only_if(ReplaceBrokenOpsWithFunctionalOpsPass, lambda ops: any(getattr(op, "is_view", False) for op in ops)))
    return stack


class _Downstreams:
    """The transitive users of every node as one bit mask per node (ExecuTorch's ``_DependencyViewer``
    keeps a Python set per node: O(nodes^2) objects)."""

    def __init__(self, gm: torch.fx.GraphModule):
        nodes = list(gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(nodes)}
        self.nodes = nodes
        masks = [0] * len(nodes)
        for i in range(len(nodes) - 1, -1, -1):  # the same walk as upstream: users before their producers
            m = 0
            for user in nodes[i].users:
                j = self.index[user]
                m |= masks[j] | (1 << j)
            masks[i] = m
        self.masks = masks

    def mask(self, nodes) -> int:
        m = 0
        for n in nodes:
            i = self.index.get(n)
            if i is not None:
                m |= 1 << i
        return m

    def downstreams_of(self, node) -> set:
        i = self.index.get(node)
        m = 0 if i is None else self.masks[i]
        return {self.nodes[j] for j in range(m.bit_length()) if m >> j & 1}


def _linear_partition_merging():
    """ExecuTorch's ``GroupBasedPartitioner`` (the XNNPACK partitioner's) builds, per node, the set of all
    downstream nodes and all upstream nodes (torch's ``CapabilityBasedPartitioner.__init__`` builds a
    third copy it then replaces), then checks every pair of partitions by iterating those sets: O(nodes^2)
    memory (1 GB for a 30-layer Llama) and most of the partitioning time. Here the downstream sets are bit
    masks and ``_can_merge_partitions`` intersects masks; same checks, same answers (the final
    ``validate_partition`` runs as upstream runs it)."""
    from executorch.exir.backend.canonical_partitioners import group_partitioner as gp
    from torch.fx.passes.infra import partitioner as fx_partitioner
    from torch.fx.passes.utils.fuser_utils import validate_partition

    upstream_init = gp.GroupBasedPartitioner.__init__

    class NotBuilt:  # torch's viewer, replaced right after it is built
        def __init__(self, graph_module):
            pass

    def init(self, graph_module, *args, **kwargs):
        with _patched(fx_partitioner, "_DependencyViewer", NotBuilt), _patched(gp, "_DependencyViewer", _Downstreams):
            upstream_init(self, graph_module, *args, **kwargs)

    def can_merge_partitions(self, p1, p2, partitions_by_id):  # upstream's checks, on bit masks
        combined = set(partitions_by_id[p1].nodes.keys()) | set(partitions_by_id[p2].nodes.keys())
        viewer = self.dependency_viewer
        combined_mask = viewer.mask(combined)
        for node in combined:
            for user in node.users:
                if user not in combined:
                    i = viewer.index.get(user)
                    if i is not None and viewer.masks[i] & combined_mask:
                        return False
        return validate_partition(list(combined))

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(gp.GroupBasedPartitioner, "__init__", init))
    stack.enter_context(_patched(gp.GroupBasedPartitioner, "_can_merge_partitions", can_merge_partitions))
    return stack


def _reuse_delegate_modules():
    """Every re-trace of a lowered program (``to_executorch``'s passes) runs each delegate call on fake
    tensors through ``call_delegate_cpu``, which rebuilds the delegate's module each time
    (``ExportedProgram.module()``: unlifting, a graph copy, a recompile). The module is built once per
    delegate here; delegates that mutate buffers keep upstream's fresh module per call."""
    import weakref

    import importlib

    from torch.fx import immutable_collections
    from torch.utils import _pytree as pytree

    ecd = importlib.import_module("torch._higher_order_ops.executorch_call_delegate")  # the package shadows it
    upstream = ecd.call_delegate_cpu
    modules = weakref.WeakKeyDictionary()

    def call_delegate_cpu(lowered_module, *args):  # upstream's body, with the module built once
        program = lowered_module.original_module
        if program.graph_signature.buffers_to_mutate:
            return upstream(lowered_module, *args)
        if lowered_module not in modules:
            modules[lowered_module] = program.module()
        immutable = {immutable_collections.immutable_dict: dict, immutable_collections.immutable_list: list}
        args = pytree.tree_map_only(tuple(immutable), lambda a: immutable[type(a)](a), args, lambda a: isinstance(a, tuple(immutable)))
        return modules[lowered_module](*args)

    return _patched(ecd, "call_delegate_cpu", call_delegate_cpu)


@contextlib.contextmanager
def _patched(owner, name: str, value):
    """``owner.name = value`` inside the block (a class attribute it inherits is shadowed, then unshadowed)."""
    missing = object()
    saved = getattr(owner, name) if isinstance(owner, types.ModuleType) else owner.__dict__.get(name, missing)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if saved is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)


def export_for_lowering(module: torch.nn.Module, args: tuple, dynamic_shapes) -> torch.export.ExportedProgram:
    """Re-export a deployable graph module (``torch.export.export``) for lowering.

    Strict export traces with Dynamo, which clones every parameter and buffer into its real-value cache
    (``cache_real_value_when_export`` in torch/_dynamo/variables/builder.py): a transient copy of all
    weights, and the slower trace. The module here is already an exported graph, so non-strict export
    traces the same program (the ``.pte`` is byte for byte the same); QHARNESS_UPSTREAM_LOWERING=1 keeps
    strict export.
    """
    with torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=_upstream_lowering())


def decompose_for_lowering(ep, partitioners: list):
    """``ep.run_decompositions({})``: functional ATen for ``to_edge_transform_and_lower``.

    Under ``fast_lowering`` the first partitioner's decomposition table is applied in the same re-trace
    (what ``to_edge_transform_and_lower`` does next, in a re-trace of its own that
    ``_skip_noop_decompositions`` then skips). Not for partitioners that transform the program before
    decomposing (``transform_for_pre_decomposition``, e.g. Arm).
    """
    from executorch.exir.backend.partitioner import Partitioner
    from executorch.exir.tracer import _default_decomposition_table

    upstream_pre = Partitioner.transform_for_pre_decomposition
    if _upstream_lowering() or not partitioners or any(type(p).transform_for_pre_decomposition is not upstream_pre for p in partitioners):
        return ep.run_decompositions({})
    table = _default_decomposition_table()
    for op in partitioners[0].ops_to_not_decompose(ep)[0]:
        table.pop(op, None)
    return ep.run_decompositions(table)


def _upstream_lowering() -> bool:
    return os.environ.get("QHARNESS_UPSTREAM_LOWERING") == "1"


@contextlib.contextmanager
def fast_lowering():
    """Within this context, lowering skips the upstream costs above (same .pte, a fraction of the time).

    Example::

        with compat.fast_lowering():
            pte = to_edge_transform_and_lower(ep, partitioner=[...]).to_executorch().buffer
    """
    if _upstream_lowering():
        yield
        return
    with contextlib.ExitStack() as stack:
        for workaround in (_shallow_node_provenance, _skip_noop_decompositions, _skip_inapplicable_xnnpack_passes,
                           _skip_inapplicable_edge_passes, _one_recompile_per_partitioning, _linear_partition_merging,
                           _reuse_delegate_modules):
            stack.enter_context(workaround())
        yield


# --- Memory ---------------------------------------------------------------------------------------
def map_large_allocations_separately(threshold: int = 1 << 20) -> bool:
    """Have glibc's malloc serve each allocation of ``threshold`` bytes or more from its own mapping.

    By default glibc raises its mmap threshold (up to 32 MiB) after the first large free, so the many
    weight-sized temporaries of export, ``convert_pt2e`` and lowering end up in the heap, which keeps
    them (RSS stays at each stage's peak and fragments). A fixed threshold unmaps them on free: peak RSS
    of export + lowering of a 12-layer, 70M-parameter Llama went from 1.86 to 1.38 GiB. Process-wide
    and permanent; glibc only (returns False elsewhere).
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_MMAP_THRESHOLD = -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))


# --- ExecuTorch lowering and runtime --------------------------------------------------------------
def to_edge_transform_and_lower(*args, **kwargs):
    import executorch.kernels.quantized  # noqa: F401  out variants of quantized ops (quantized embeddings)
    from executorch.exir import to_edge_transform_and_lower as _lower

    return _lower(*args, **kwargs)


def executorch_backend_config(**kwargs):
    from executorch.exir import ExecutorchBackendConfig

    return ExecutorchBackendConfig(**kwargs)


def executorch_runtime():
    """The ExecuTorch Python runtime, with the quantized kernels (e.g. quantized embeddings) registered."""
    import executorch.kernels.quantized  # noqa: F401  registers quantized_decomposed ops
    from executorch.runtime import Runtime

    llm_custom_ops()  # llama::update_cache / custom_sdpa kernels of fast-path programs

    return Runtime.get()


# --- transformers ---------------------------------------------------------------------------------
def hf_static_cache_exportable(model, batch_size: int, max_cache_len: int):
    """HF's static-KV-cache wrapper whose forward is ``(input_ids, cache_position) -> logits``."""
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        cache_config={"batch_size": batch_size, "max_cache_len": max_cache_len},
    )
    return TorchExportableModuleForDecoderOnlyLM(model, batch_size=batch_size, max_cache_len=max_cache_len).model


# --- ExecuTorch LLM custom ops ------------------------------------------------------------------
_CPU_SDPA_LIB = None


def llm_custom_ops() -> None:
    """Register ``llama::update_cache`` / ``llama::custom_sdpa`` (eager kernels, export meta functions and,
    in the Python runtime, their ExecuTorch kernels), with ``custom_sdpa``'s eager CPU kernel replaced.

    Workaround: ExecuTorch 1.5.1's eager (AOT) ``custom_sdpa`` runs its kernel with a context that has no
    temp allocator and logs ``No temp allocator provided`` to stderr on every call (every layer of every
    calibration or scoring step). ``_custom_sdpa_cpu`` computes the same attention with PyTorch's SDPA
    for CPU tensors; export (Meta kernel) and the ``.pte`` (ExecuTorch's kernel) are unaffected.
    Test: tests/test_compat.py (fails once upstream stops logging).
    """
    global _CPU_SDPA_LIB
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401

    if _CPU_SDPA_LIB is None:
        _CPU_SDPA_LIB = torch.library.Library("llama", "IMPL")
        _CPU_SDPA_LIB.impl("custom_sdpa", _custom_sdpa_cpu, "CPU")


def _custom_sdpa_cpu(query, key, value, start_pos, attn_mask=None, drpout_p=0.0, is_causal=False, scale=None):
    """``llama::custom_sdpa`` in PyTorch: ``query [B, n, H, D]`` over caches ``[B, S, H_kv, D]``. Causal:
    query ``i`` sees cache positions ``<= start_pos + i``; with ``attn_mask`` (additive, ``[n, S]``) every
    position under the mask; otherwise positions ``< start_pos + n``. Plain matmuls and softmax: torch's
    fused CPU SDPA took milliseconds per call on tiny decode shapes on a busy machine."""
    b, n, h, d = query.shape
    if attn_mask is None:
        key, value = key[:, : start_pos + n], value[:, : start_pos + n]
    kv_heads, length = key.shape[2], key.shape[1]
    q = query.reshape(b, n, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)  # [B, H_kv, rep, n, D]
    scores = q @ key.permute(0, 2, 3, 1).unsqueeze(2) * (d**-0.5 if scale is None else scale)  # [B, H_kv, rep, n, L]
    if attn_mask is not None:
        scores = scores + attn_mask
    elif is_causal:
        hidden = torch.arange(length)[None, :] > (start_pos + torch.arange(n))[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()  # softmax by hand: aten::softmax took ~1 ms on tiny
    weights = weights / weights.sum(-1, keepdim=True)  # shapes (its parallel_for), busy machine
    out = weights @ value.permute(0, 2, 1, 3).unsqueeze(2)  # [B, H_kv, rep, n, D]
    return out.permute(0, 3, 1, 2, 4).reshape(b, n, h, d).contiguous()


def upstream_custom_sdpa(*args):
    """ExecuTorch's own eager ``custom_sdpa`` kernel (bypassing ``_custom_sdpa_cpu``), for the workaround's test."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return torch.ops.llama.custom_sdpa.default.redispatch(keys, *args)
