"""After the runs: wandb tracking, the accuracy-vs-latency report and the sweep over recipes."""
