"""Checks on what was deployed: scoring and the parity gate of the ``.pte`` against the converted model."""
