"""Benchmarks and studies: `python -m bench.quality`, and the scripts bench/<name>.py with their results in
bench/results/."""
