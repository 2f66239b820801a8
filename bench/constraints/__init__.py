"""Constrained decoding benchmarks: the grammar engines on our tokenizer (issue 26)."""
