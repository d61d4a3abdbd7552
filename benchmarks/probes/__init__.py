"""One-off probes of what this CPU does without the engine (``python -m benchmarks.probes.<name>``)."""
