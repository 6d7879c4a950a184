"""`gradmesh bench NAME`: benchmarks by name. Each interleaves what it compares in one run, warms
up, repeats, and reports medians and ratios against a reference measured in the same run."""
