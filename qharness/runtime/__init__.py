"""Running ``.pte`` programs through the ExecuTorch runtime: loading, generation, benchmarks."""
