"""After the runs: wandb tracking and the accuracy-vs-latency report (tables, Pareto plots, the pick)."""
