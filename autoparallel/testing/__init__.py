"""Helpers for tests and benchmarks: launching real multi-rank jobs and comparing tensors."""
