"""Benchmarks: `python -m benchmarks.run NAME` writes benchmarks/results/NAME.json and prints a table."""
