"""Benchmark scripts: run each as ``python benchmarks/<name>.py``; shared helpers in _common."""
