"""Serving benchmarks: a whole mesh (or its gateway and ranks) under load, and the step kinds it runs."""
