"""qharness as a library: whole jobs (``jobs.py``), the LightningCLI behind run configs (``lightning_cli.py``) and
the config checks that run before torch loads (``precheck.py``)."""
