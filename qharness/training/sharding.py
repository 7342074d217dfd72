"""Sharded training (FSDP2 through Lightning's ``ModelParallelStrategy``): each decoder layer is its own unit.

``--trainer.strategy fsdp_layers`` is ``ModelParallelStrategy`` with every process in the data-parallel dimension
(no tensor parallelism) and consolidated checkpoints (one ``last.ckpt`` file that ``qharness export`` reads on one
CPU process, and ``--ckpt_path last`` resumes with the same number of processes). The units are
``layerwise.units``: each decoder layer's graph (``model.layerwise: true``) or, for torchao source-level recipes,
each eager decoder layer; the embedding, final norm and a tied output head stay in the root unit.

Example::

    qharness fit cfg.yaml --model.layerwise true --trainer.strategy fsdp_layers --trainer.devices 8
"""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry

from qharness.training.layerwise import units

NAME = "fsdp_layers"


class LayerFSDPStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` for FSDP alone: data-parallel size = all processes, tensor-parallel size 1,
    consolidated (full) checkpoints unless ``save_distributed_checkpoint`` is set."""

    def __init__(self, save_distributed_checkpoint: bool = False, **kwargs):
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_processes * self.num_nodes
        self._tensor_parallel_size = 1
        super().setup_environment()


if NAME not in StrategyRegistry:
    StrategyRegistry.register(
        NAME, LayerFSDPStrategy, description="FSDP2, one unit per decoder layer, consolidated checkpoints (qharness)"
    )


def is_model_parallel(strategy) -> bool:
    """Whether a Lightning strategy shards with FSDP2 (``fsdp_layers`` or a ``ModelParallelStrategy`` of the user's)."""
    return isinstance(strategy, ModelParallelStrategy)


def shardable_units(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``units(root)`` without those sharing a parameter with the rest of the model (a tied output head): a
    parameter must belong to one unit, so those stay in the root unit."""
    counts: dict[int, int] = {}
    for _, p in root.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    out = []
    for name, m in units(root):
        inside: dict[int, int] = {}
        for _, p in m.named_parameters(remove_duplicate=False):
            inside[id(p)] = inside.get(id(p), 0) + 1
        if all(counts[i] == n for i, n in inside.items()):
            out.append((name, m))
    return out


def shard(root: torch.nn.Module, mesh) -> int:
    """``fully_shard`` each unit of ``root`` over ``mesh`` (the data-parallel mesh), then ``root`` itself; returns
    the number of units. Parameters become ``DTensor`` shards; buffers (observers) stay whole on every process."""
    from torch.distributed.fsdp import fully_shard

    found = shardable_units(root)
    for _, m in found:
        fully_shard(m, mesh=mesh)
    fully_shard(root, mesh=mesh)
    return len(found)


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds FSDP-sharded (DTensor) parameters."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state dict on CPU on global rank 0, ``{}`` elsewhere. Every process must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
