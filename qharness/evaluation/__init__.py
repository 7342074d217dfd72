"""lm-eval over a run's models (FP, fake-quant, converted, ``.pte``): the adapter, the offline tasks, the table."""
