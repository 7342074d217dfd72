"""The run config's schema: one typed, torch-free dataclass per section, each field with its type, default and help.

``RunConfig`` holds the sections: ``model`` (``ModelConfig``, with ``Distill`` and ``LoRA``), ``data``
(``DataConfig``), ``trainer`` and ``checkpoint`` (the Lightning fields qharness reads), and ``deploy``, ``parity``,
``calibration``, ``bench``, ``eval``, ``wandb`` (``qharness.config``). Derived from it: the CLI's ``--model.*`` and
``--data.*`` options and their ``--help`` (``QuantLM`` and ``TextDataModule`` take their fields from the dataclasses),
the check before torch loads (``api/precheck.py``), the Python API's configs, and ``docs/config-reference.md``
(``python -m qharness.schema.reference``).

Adding a field: declare it, with its default and an ``Args:`` line, in its section's dataclass (and a rule in that
section's ``validate()`` if it needs one); ``tests/test_schema.py`` checks that it reaches every place above.
"""

from qharness.config import BenchConfig, CalibrationConfig, EvalConfig, ExportConfig, ParityConfig, WandbConfig
from qharness.schema.data import DataConfig
from qharness.schema.model import Distill, LoRA, ModelConfig
from qharness.schema.run import RunConfig
from qharness.schema.trainer import CheckpointConfig, TrainerConfig

__all__ = [
    "BenchConfig",
    "CalibrationConfig",
    "CheckpointConfig",
    "DataConfig",
    "Distill",
    "EvalConfig",
    "ExportConfig",
    "LoRA",
    "ModelConfig",
    "ParityConfig",
    "RunConfig",
    "TrainerConfig",
    "WandbConfig",
]
