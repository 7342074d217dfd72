"""The ``qharness`` command line: one table from subcommand to function (``main``), LightningCLI for run configs."""
