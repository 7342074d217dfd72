"""Speed-up: partition merging on bit masks instead of O(nodes^2) Python sets (GroupBasedPartitioner)."""

from __future__ import annotations

import contextlib

import torch

from qharness.upstream.lowering.patching import patched


class Downstreams:
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


def patch():
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
        with patched(fx_partitioner, "_DependencyViewer", NotBuilt), patched(gp, "_DependencyViewer", Downstreams):
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
    stack.enter_context(patched(gp.GroupBasedPartitioner, "__init__", init))
    stack.enter_context(patched(gp.GroupBasedPartitioner, "_can_merge_partitions", can_merge_partitions))
    return stack
