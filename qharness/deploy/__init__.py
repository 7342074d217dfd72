"""Deployment: static-KV-cache export (fast path or HF's), quantization for deploy, lowering to a ``.pte``."""
