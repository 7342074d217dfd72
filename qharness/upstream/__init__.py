"""Everything that depends on upstream internals or moving imports (see ARCHITECTURE.md, 'Upstream').

- ``imports``: symbols that move between torchao / ExecuTorch / transformers releases, one function each.
- ``fixes/``: correctness workarounds, one module per upstream bug, each naming the issue and with a test that
  fails once upstream no longer needs it (tests/test_upstream_fixes.py).
- ``lowering/``: lowering speed-ups, one module per patch, byte-identical to upstream (tests/test_upstream_lowering.py).
- ``process``: process-wide settings (never applied at import time).
- ``torchtune``: the torchtune 0.6.1 import shim."""
