"""Training (QAT) and calibration (PTQ) of the exported, PT2E-prepared graph: the LightningModule and its helpers."""
