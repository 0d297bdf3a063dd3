"""Benchmarks: `python -m benchmarks.run NAME [options]` writes benchmarks/results/NAME[-<shape>].json and prints a
table; `python -m benchmarks.run --help` lists the benchmarks, `... NAME --help` one's options."""
