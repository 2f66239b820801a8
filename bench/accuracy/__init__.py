"""Accuracy checks: the served model's logits against transformers on the same weights."""
