"""Checks of an exported file against PyTorch (compress.quant.verify): near ties in the int8 agreement, fp32
parity relative to the size of the logits."""

import numpy as np
import pytest
import torch


def test_int8_agreement_counts_near_ties_within_two_output_steps():
    from compress.quant.verify import compare

    torch_logits = torch.tensor([[1.00, 0.95, 0.0], [2.0, 0.0, 1.0], [0.0, 1.0, 3.0]])
    onnx_logits = np.array([[0.9, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 3.0]], dtype=np.float32)
    loader = [(torch.zeros(3, 1), torch.tensor([0, 0, 2]))]

    class Fixed(torch.nn.Module):
        def forward(self, x):
            return torch_logits

    report = compare(Fixed(), lambda x: onnx_logits, loader, tie=0.1)
    # image 0 is a near-tie (0.95 vs 1.00): agreeing within the tie, not exactly; image 1 is a real disagreement
    assert report["top1_agreement"] == pytest.approx(1 / 3) and report["top1_within_tie"] == pytest.approx(2 / 3)
    assert compare(Fixed(), lambda x: onnx_logits, loader)["top1_within_tie"] == pytest.approx(1 / 3)
    # logits left float: two steps of 8-bit resolution over their range (3.0 / 255 * 2 = 0.0235) - too fine here
    assert compare(Fixed(), lambda x: onnx_logits, loader, tie=None)["top1_within_tie"] == pytest.approx(1 / 3)


def test_fp32_parity_scales_with_the_logits():
    """float32 rounds to a share of the number: logits in the millions (a student whose activations blew up) differ
    by tens between two correct implementations, and that is not an exporter difference; logits near 1 keep the
    absolute limit."""
    import dataclasses
    from types import SimpleNamespace

    from compress.deploy.export_report import Parity
    from compress.quant.verify import checks, compare

    loader = [(torch.zeros(2, 1), torch.tensor([0, 1]))]

    def parity(torch_logits, onnx_logits):
        class Fixed(torch.nn.Module):
            def forward(self, x):
                return torch.tensor(torch_logits)

        fp32 = compare(Fixed(), lambda x: np.array(onnx_logits, dtype=np.float32), loader)
        fp32.pop("correct")
        parity = Parity(**fp32)
        e = SimpleNamespace(fp32_max_abs_diff=1e-3, fp32_min_agreement=1.0, int8_min_agreement=0.99)
        found = checks(parity, dataclasses.replace(parity, top1_within_tie=1.0), {"QLinearConv": 1}, e)["fp32_parity"]
        return fp32, {"ok": found.ok, "detail": found.detail}

    fp32, check = parity([[1.2e6, -3e5], [-2e5, 9e5]], [[1.2e6 + 28.5, -3e5], [-2e5, 9e5 - 4]])
    assert fp32["max_abs_diff"] == pytest.approx(28.5) and fp32["max_scaled_diff"] == pytest.approx(28.5 / 1.2e6)
    assert check["ok"] and "logits up to 1.2e+06" in check["detail"]
    fp32, check = parity([[0.5, -0.25], [0.1, 0.9]], [[0.5, -0.25], [0.1, 0.9 + 2e-3]])  # the absolute limit
    assert not check["ok"] and fp32["max_scaled_diff"] == pytest.approx(2e-3, rel=1e-3)
    assert "export.fp32_max_abs_diff=0.003" in check["detail"]
    fp32, check = parity([[20.0, -5.0], [1.0, 3.0]], [[20.01, -5.0], [1.0, 3.0]])  # 0.01 of 20: 5e-4, within
    assert check["ok"] and fp32["max_scaled_diff"] == pytest.approx(5e-4, rel=1e-2)
    fp32, check = parity([[20.0, -5.0], [1.0, 3.0]], [[float("nan"), -5.0], [1.0, 3.0]])  # a broken float student
    assert not check["ok"] and "the logits are not finite (NaN or inf)" in check["detail"]
