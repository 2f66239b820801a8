"""Quantized checkpoints (issue 29): block FP8 and 4-bit AWQ weights in their stored layouts.

formats.py holds the layouts and the (de)quantizing arithmetic, linear.py the
QuantWeight a model keeps for each quantized projection (and each stack of
expert projections), dispatch.py which path computes with them (a registered
kernel, or dequantized weights), loading.py how checkpoint.py reads and checks
them, routing.py the top-k routing agreement of a quantized model with its
dequantized twin.
"""
