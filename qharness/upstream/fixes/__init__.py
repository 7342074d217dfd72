"""Correctness workarounds for upstream bugs, one module per bug; each names its upstream issue and how to retire it."""
