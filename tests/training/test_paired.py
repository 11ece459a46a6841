"""Paired comparisons (compress.training.paired): McNemar's exact test on the images only one file gets
right."""

import numpy as np
import torch


def test_qat_against_ptq_counts_the_images_only_one_gets_right_and_tests_them_exactly():
    """McNemar's exact test by hand: with n images only one file gets right, and k the fewer of them,
    p = 2 * sum(C(n, i), i <= k) / 2^n, capped at 1."""
    from compress.quant.verify import onnx_correct
    from compress.training.paired import paired

    qat = np.array([True] * 10 + [True, False, False, False, False, False, False, False, False])
    ptq = np.array([True] * 10 + [False, True, True, True, True, True, True, True, True])
    assert paired(qat, ptq) == {"only_first": 1, "only_second": 8, "p": 0.03906}  # 2 * (1 + 9) / 512
    assert paired(ptq, ptq) == {"only_first": 0, "only_second": 0, "p": 1.0}
    assert paired(qat[:12], ptq[:12])["p"] == 1.0  # one each way: 2 * (1 + 2) / 4, capped
    assert paired(np.zeros(6, bool), np.ones(6, bool))["p"] == 0.03125  # 2 / 64
    many = np.arange(45000)
    assert 0 < paired(many < 20000, many >= 20000)["p"] < 1e-100  # 20,000 vs 25,000: milliseconds, not minutes
    loader = [(torch.zeros(2, 1), torch.tensor([0, 1])), (torch.zeros(1, 1), torch.tensor([2]))]
    logits = iter([np.array([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), np.array([[0.0, 0.0, 1.0]])])
    assert onnx_correct(lambda x: next(logits), loader).tolist() == [True, False, True]
