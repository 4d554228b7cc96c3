"""Benchmarks (not tests): each measures against a baseline in the same run and writes JSON."""
