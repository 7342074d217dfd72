"""qharness: quantization training harness for on-device LLMs (QAT/PTQ -> lm-eval -> ExecuTorch .pte)."""

__version__ = "0.1.0"
