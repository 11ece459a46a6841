"""Models from torchvision and from users' own code (compress.models.sources): built and adapted to the data,
and the file that defines a model followed by the code digest."""

import textwrap

import torch

from compress.models.registry import build_model, source_problem


def test_user_model_function_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "team_models.py").write_text(textwrap.dedent("""\
        import torch.nn as nn

        def tiny(num_classes, in_channels):
            return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(8, num_classes))
        """))
    monkeypatch.chdir(tmp_path)
    assert source_problem("team_models:tiny") is None
    model = build_model("team_models:tiny", (1, 8, 8), 4)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 4)
    assert "has no function 'huge'" in source_problem("team_models:huge")


def test_torchvision_models_adapt_to_grayscale_and_classes():
    model = build_model("torchvision:efficientnet_b0", (1, 64, 64), 3)
    assert model(torch.zeros(1, 1, 64, 64)).shape == (1, 3)
    assert source_problem("torchvision:mobilenet_v3_smal") == (
        "torchvision has no classification model 'mobilenet_v3_smal' (did you mean 'torchvision:mobilenet_v3_small'?);"
        " see torchvision.models.list_models() for the names")


def test_the_code_digest_follows_the_file_that_defines_the_model(tmp_path, monkeypatch):
    """The review's point: `pkg:net` re-exported by pkg/__init__.py from pkg/nets.py hashed __init__.py."""
    from compress.models.sources import code_digest

    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo" / "__init__.py").write_text("from zoo.nets import net\n")
    (tmp_path / "zoo" / "nets.py").write_text("import torch.nn as nn\n\ndef net(num_classes):\n"
                                              "    return nn.Linear(4, num_classes)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = code_digest("zoo:net")
    assert before == code_digest("zoo:net")
    assert code_digest("resnet14") == code_digest("torchvision:resnet18") == ""
    (tmp_path / "zoo" / "nets.py").write_text((tmp_path / "zoo" / "nets.py").read_text() + "# edited\n")
    assert code_digest("zoo:net") != before
