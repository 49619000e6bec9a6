"""Tensor parallelism: process groups, sharded layers' collectives, and the worker processes."""
