"""Fixes for ExecuTorch 1.5.1's Vulkan quantizer and partitioner (recipe ``vulkan_int8w``).

Upstream: the scalar lifting is the code of https://github.com/pytorch/executorch/issues/22062 in
``VulkanQuantizer.transform_for_annotation``; the buffer-output tagging has no upstream issue yet
(seen with HF's static-cache ``cumulative_length`` counters). Tests: tests/test_upstream_fixes.py (Vulkan cases).
Retire: delete the subclass whose test fails and use the upstream class in qharness/recipes/registry.py.
"""

from __future__ import annotations


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
