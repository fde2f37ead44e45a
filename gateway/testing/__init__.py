"""Stand-ins for the model in gateway tests and benchmarks (never imported by the serving path)."""
