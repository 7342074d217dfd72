"""The Vulkan GPU backend's PT2E quantizer and partitioner, with typed settings (lowered here, runs on devices)."""

from __future__ import annotations

from dataclasses import dataclass

from qharness.errors import UserError
from qharness.recipes.registration import register_partitioner, register_quantizer


@dataclass(frozen=True)
class VulkanSettings:
    """``quantizer: {name: vulkan, ...}``. weight_bits: 4 or 8. dynamic: false (weight-only; dynamic is not supported yet)."""

    weight_bits: int = 8
    dynamic: bool = False

    def __post_init__(self):
        if self.weight_bits not in (4, 8):
            raise UserError(f"vulkan quantizer: weight_bits={self.weight_bits} is not supported", fix="use 4 or 8")
        if self.dynamic:
            raise UserError(
                "vulkan quantizer: dynamic activations are not supported yet", fix="use dynamic: false (weight-only)"
            )


@register_quantizer("vulkan", VulkanSettings, kind="pt2e", backend="vulkan")
def vulkan_quantizer(settings: VulkanSettings, is_qat: bool):
    from qharness.upstream import imports
    from qharness.upstream.fixes import vulkan

    config = imports.vulkan_symmetric_config(is_dynamic=False, weight_bits=settings.weight_bits)
    return vulkan.vulkan_quantizer_cls()().set_global(config)


@register_partitioner("vulkan", backend="vulkan")
def vulkan_partitioner():
    from qharness.upstream.fixes import vulkan

    return vulkan.vulkan_partitioner()
