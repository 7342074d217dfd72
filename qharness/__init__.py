"""qharness: quantization training harness for on-device LLMs (QAT/PTQ -> lm-eval -> ExecuTorch .pte).

The Python API (docs/python-api.md): QAT in your own training loop, then a checked ``.pte``::

    import torch, qharness
    qm = qharness.prepare(hf_model, "xnnpack_8da4w", batch_size=8, seq_len=128, tokenizer=tok)
    opt = torch.optim.AdamW(qm.parameters(), lr=1e-4)
    for batch in batches:                                  # LongTensor [8, 128] token blocks
        loss = qm(batch, labels=batch).loss
        loss.backward(); opt.step(); opt.zero_grad()
    result = qharness.export(qm, "out/", calibration=train_text, validation=val_text)
    print(result.pte_path, result.size_bytes, result.parity.passed)
    print(qharness.Pte.load(result.pte_path).generate("def main():", max_new_tokens=32))

PTQ: ``qharness.calibrate(qharness.prepare(m, recipe, mode="ptq", ...), batches)`` then ``export``.
A whole configured job, as ``qharness calibrate CONFIG`` runs it: ``qharness.run_job("configs/ptq_xnnpack.yaml",
"calibrate")`` -> the typed ``RunSummary``; ``qharness.sweep(...)``, ``qharness.report(...)``; which recipe to ship:
``qharness.ship("configs/ship_xnnpack.yaml", "2%", max_size_mb=2.0)`` (docs/ship.md).
``import qharness`` loads no torch: each name loads its module on first use. The CLI: ``qharness --help``.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module of qharness.api that defines it (loaded on first use: PEP 562)
_EXPORTS = {
    "list_recipes": "qharness.api.recipes",
    "load_recipe": "qharness.api.recipes",
    "Recipe": "qharness.api.recipes",
    "prepare": "qharness.api.prepare",
    "calibrate": "qharness.api.prepare",
    "QuantizedModel": "qharness.api.prepare",
    "export": "qharness.api.export",
    "ExportResult": "qharness.api.export",
    "Pte": "qharness.api.pte",
    "evaluate": "qharness.api.evaluate",
    "QuantizationCallback": "qharness.api.lightning",
    "run_job": "qharness.api.jobs",
    "sweep": "qharness.api.jobs",
    "report": "qharness.api.jobs",
    "ship": "qharness.api.ship",
    "RunSummary": "qharness.run.summary",
    "UserError": "qharness.errors",
    "ParityError": "qharness.errors",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    """The public names, each loaded from its module on first use (PEP 562): ``import qharness`` stays torch-free."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qharness' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    """The module's names and the lazily loaded public ones (``help(qharness)`` lists them)."""
    return sorted({*globals(), *__all__})
