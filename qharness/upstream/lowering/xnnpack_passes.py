"""Speed-up: skip XNNPACK preprocess passes that cannot act on a partition (each is a full re-trace)."""

from __future__ import annotations

import torch

from qharness.upstream.lowering.patching import aten_op, called_ops, op_named, patched

SDPA_PATTERN_OPS = (
    "aten._softmax.default",
    "aten.add.Tensor",
    "aten.any.dim",
    "aten.bmm.default",
    "aten.eq.Scalar",
    "aten.expand_copy.default",
    "aten.full_like.default",
    "aten.logical_not.default",
    "aten.mul.Scalar",
    "aten.permute_copy.default",
    "aten.view_copy.default",
    "aten.where.self",
    "dim_order_ops._clone_dim_order.default",
)


def pass_triggers() -> dict:
    """XNNPACK preprocess pass -> ``applies(ops)``: whether it can act on a partition calling ``ops``
    (ATen overloads). Otherwise the pass would only re-trace the partition. Read from ExecuTorch 1.5.1's
    ``backends/xnnpack/_passes``; tests/test_upstream_lowering.py checks the pass list and the patterns. Passes not
    named here always run."""
    from executorch.backends.xnnpack._passes.convert_to_linear import ConvertToLinearPass
    from executorch.backends.xnnpack._passes.decompose_batch_norm import DecomposeBatchNorm
    from executorch.backends.xnnpack._passes.fuse_activation_pass import FuseActivationPass
    from executorch.exir.passes.memory_format_ops_pass import MemoryFormatOpsMap

    def any_of(*ops):
        wanted = {aten_op(op) for op in ops}
        return lambda present: bool(wanted & present)

    aten = torch.ops.aten
    batch_norm = any_of(*DecomposeBatchNorm.BATCH_NORM_OPS)
    sdpa = {op_named(name) for name in SDPA_PATTERN_OPS}
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


def patch():
    """``XnnpackBackend.preprocess`` runs 17 passes on every partition, each a full fake-tensor re-trace
    (an HF Llama layer splits into ~12 partitions: 200 re-traces per layer). Passes that cannot act on
    the partition are skipped (``pass_triggers``); ``PropagateCustomMetaPass`` runs only when a
    node carries ``meta["custom"]``, the one thing it copies. The rest run as upstream runs them
    (``XNNPACKPassManager.transform``)."""
    from executorch.backends.xnnpack._passes import XNNPACKPass, XNNPACKPassManager
    from executorch.exir.pass_base import ExportPass
    from executorch.exir.program._program import _transform

    triggers = pass_triggers()

    def applies(pass_, gm) -> bool:
        if pass_.__name__ == "PropagateCustomMetaPass":
            return any("custom" in n.meta for n in gm.graph.nodes)
        trigger = triggers.get(pass_.__name__)
        return trigger is None or trigger(called_ops(gm))

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
                raise RuntimeError(
                    f"Expecting ExportPass or ExportPass(), but got pass: {pass_} with type: {type(pass_)}"
                )
        return ep

    return patched(XNNPACKPassManager, "transform", transform)
