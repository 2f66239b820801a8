"""Benchmarks of moemesh: serving speed, failover and chaos, kernels, accuracy (bench/README.md)."""
