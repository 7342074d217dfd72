"""The public Python API (``qharness.prepare``, ``export``, ``Pte``, ``run_job``, ...): one module per job, each a thin
layer over the stages the CLI runs (``training/``, ``run/``, ``runtime/``, ``evaluation/``), so a ``.pte`` made here
is the program the CLI makes. The names are exported lazily from ``qharness/__init__.py``. Whole jobs (a run config,
a sweep, a report) are ``jobs.py``; the LightningCLI behind run configs is ``lightning_cli.py`` (its Trainer ``trainer.py``,
its checks of the parsed config ``preflight.py``) and the config checks that run before torch loads ``precheck.py``.

Loading it hides the upstream messages the CLI hides (``upstream/quiet.py``, each with its reason; not with
``QHARNESS_VERBOSE=1``) and shows qharness's stage lines (the ``qharness`` logger at INFO).
"""

from qharness.upstream import quiet

quiet.install()
