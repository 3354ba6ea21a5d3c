"""Parallel strategies: data, tensor, pipeline, sharding, recompute, amp."""
