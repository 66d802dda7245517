"""Speed and memory benchmarks: the scripts bench/<name>.py (`python -m bench.<name>`), with their results in
bench/results/. Sample quality is measured by the studies (studies/)."""
