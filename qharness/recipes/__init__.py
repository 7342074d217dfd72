"""Backend recipes: YAML files under ``builtin/`` and the registry of quantizer/partitioner builders they name."""
