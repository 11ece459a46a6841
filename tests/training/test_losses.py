"""The label loss (compress.training.losses): unlabelled and mixed images."""

import pytest
import torch
import torch.nn.functional as F

from compress.data.imageset import Batch


def test_unlabelled_and_mixed_images_in_the_label_loss():
    from compress.training.losses import label_loss

    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y, partner = torch.tensor([0, -1, 1]), torch.tensor([0, -1, 0])
    batch = Batch(None, y, None, None, partner, torch.tensor([1.0, 1.0, 0.25]))
    each = [F.cross_entropy(logits[i:i + 1], torch.tensor([c])).item() for i, c in ((0, 0), (2, 1), (2, 0))]
    # sample 0: its own label, weight 1; sample 1: unlabelled, weight 0; sample 2: 1/4 own label, 3/4 partner's
    expected = (each[0] + 0.25 * each[1] + 0.75 * each[2]) / 2.0
    assert label_loss(logits, batch).item() == pytest.approx(expected, rel=1e-6)
