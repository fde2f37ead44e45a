"""Made-up models for `loraplex serve` with no --model, tests and benchmarks: tiny random checkpoints, a null worker."""
