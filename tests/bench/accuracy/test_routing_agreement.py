"""bench/accuracy/routing_agreement.py on the CPU (tiny model): the reference path routes exactly as the
dequantized twin, quantization itself moves some tokens to other experts, and the agreement arithmetic."""

import json

import pytest
import torch

from bench.accuracy import routing_agreement


def test_agreement_counts_shared_experts_per_token():
    a = torch.tensor([[0, 1], [2, 3], [4, 5]])
    b = torch.tensor([[1, 0], [2, 6], [7, 8]])
    assert routing_agreement.agreement(a, b) == {"overlap": 0.5, "exact": pytest.approx(1 / 3)}


def test_tiny_models_against_their_twins_and_the_original(tmp_path):
    assert routing_agreement.main(["--device", "cpu", "--preset", "tiny", "--quant", "awq", "--prompts", "2",
                                   "--prompt-tokens", "32", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "routing_agreement_cpu.md").read_text()
    assert "## awq (path `reference`)" in text
    result = json.loads((tmp_path / "routing_agreement_cpu.json").read_text())
    layers = result["formats"]["awq"]["layers"]
    assert [r["layer"] for r in layers] == [0, 2, 3] and all(r["tokens"] == 64 for r in layers)
    assert all(r["twin"] == {"overlap": 1.0, "exact": 1.0} for r in layers)
    assert min(r["original"]["overlap"] for r in layers) < 1.0  # 4-bit weights move some tokens
