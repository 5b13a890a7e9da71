"""Benchmarks (`servelm bench ...`): they print JSON and compare systems side by side as ratios."""
