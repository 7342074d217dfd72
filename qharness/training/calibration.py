"""PTQ calibration through Lightning: a prepared deploy graph's observers see N blocks of data.

Example::

    blocks = calibration_blocks(CalibrationConfig(blocks=32), datamodule)
    calibrate(prepared_graph, blocks)      # trainer.predict over the blocks, with a progress bar
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from qharness.config import CalibrationConfig
from qharness.data.datamodule import pack
from qharness.errors import UserError
from qharness.progress import stage
from qharness.upstream import imports, pt2e_modes


class Calibrator(L.LightningModule):
    """Runs ``graph(tokens[1, n], input_pos=[0])`` per block; the observers inside record ranges."""

    def __init__(self, graph: torch.fx.GraphModule):
        super().__init__()
        # Not a submodule: Lightning's move to the (CPU) device would try to swap every parameter, which fails on a
        # torchao-quantized weight (a PT2E recipe's quantized embedding table, recipes/embedding.py). Calibration runs
        # on the CPU graph as it is; its mode is switched here.
        object.__setattr__(self, "graph", pt2e_modes.allow_train_eval(graph))

    def on_predict_start(self) -> None:
        self.graph.eval()

    def predict_step(self, batch, batch_idx):
        (tokens,) = batch
        self.graph(tokens, torch.zeros(1, dtype=torch.long))


def calibration_blocks(cfg: CalibrationConfig, dm) -> torch.Tensor:
    """``[blocks, seq_len]`` token blocks: the training split of ``data``, or ``calibration.source`` (read in the data's
    format: chat/instruction records are rendered as in training)."""
    if cfg.blocks < 1:
        raise UserError(f"calibration.blocks must be positive (got {cfg.blocks})")
    if cfg.source is None:
        x = dm.train_x
    else:
        x, _ = pack(dm.tokens_of(cfg.source, cfg.text_field, field="calibration.source")[0], dm.seq_len)
        if len(x) == 0:
            raise UserError(
                f"calibration.source {cfg.source} holds less than one block of data.seq_len={dm.seq_len} tokens"
            )
    return x[: cfg.blocks]


def observes_activations(graph: torch.fx.GraphModule) -> bool:
    """Whether ``graph`` (prepared for PTQ) has an observer of a static activation range, whose calibration needs data.
    Weights (constants) and dynamic activations (quantized per call) are observed in one pass over any block."""
    pt2e = imports.pt2e()
    modules = dict(graph.named_modules())
    for node in graph.graph.nodes:
        observer = modules.get(node.target) if node.op == "call_module" else None
        if isinstance(observer, pt2e.ObserverBase) and not getattr(observer, "is_dynamic", False):
            if not (isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "get_attr"):
                return True
    return False


def calibrate(graph: torch.fx.GraphModule, blocks: torch.Tensor) -> None:
    """Run ``blocks`` through ``graph``'s observers: all of them where it observes static activation ranges, else one
    (weights and dynamic activations need no data: more blocks would compute the same scales)."""
    if not observes_activations(graph):
        blocks = blocks[:1]
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_model_summary=False
    )
    with stage(f"calibrating the observers on {len(blocks)} block{'s' if len(blocks) != 1 else ''}"):
        trainer.predict(Calibrator(graph), DataLoader(TensorDataset(blocks), batch_size=1), return_predictions=False)
