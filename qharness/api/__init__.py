"""The public Python API (``qharness.prepare``, ``export``, ``Pte``, ...): one module per job, each a thin layer over
the stages the CLI runs (``training/``, ``run/pipeline.py``, ``runtime/``, ``evaluation/``), so a ``.pte`` made here
is the program the CLI makes. The names are exported lazily from ``qharness/__init__.py``."""
