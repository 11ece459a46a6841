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
    """`pkg:net` re-exported by pkg/__init__.py from pkg/nets.py is digested by pkg/nets.py, the file that defines
    it, not by __init__.py."""
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


def test_the_code_digest_covers_the_files_of_yours_the_model_imports(tmp_path, monkeypatch):
    """my_models.py does `from my_layers import Block`: editing my_layers.py runs the model's stages again. Files of
    the folder the model does not use, a package's submodule only imported elsewhere in the process, and library
    folders inside the project (a virtual environment) do not count, and the digest is the same however often it
    is computed and whatever else has been imported."""
    import hashlib
    import importlib
    import os

    from compress.models import sources

    files = {
        "digest_models.py": """\
            import torch.nn as nn
            import digest_kit.heads
            from digest_layers import Block
            from digest_vendored import helper

            def net(num_classes):
                return nn.Sequential(Block(), digest_kit.heads.Head(num_classes))
            """,
        "digest_layers.py": """\
            import torch.nn as nn

            class Block(nn.Module):
                def forward(self, x):
                    return x
            """,
        "digest_kit/__init__.py": "",
        "digest_kit/heads.py": """\
            import torch.nn as nn

            class Head(nn.Linear):
                def __init__(self, num_classes):
                    super().__init__(4, num_classes)
            """,
        "digest_kit/extra.py": "EXTRA = 1\n",
        "digest_unrelated.py": "UNRELATED = 1\n",
        "venv/digest_vendored.py": "def helper():\n    return 1\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path / "venv"))
    monkeypatch.syspath_prepend(str(tmp_path))
    venv = os.path.realpath(tmp_path / "venv")  # as if a virtual environment's site-packages in the project folder
    monkeypatch.setattr(sources, "_library_folders", lambda: [venv])

    def edit(rel):
        with open(tmp_path / rel, "a") as f:
            f.write("# edited\n")

    before = sources.code_digest("digest_models:net")
    assert before == sources.code_digest("digest_models:net")
    assert before != hashlib.sha256((tmp_path / "digest_models.py").read_bytes()).hexdigest()
    importlib.import_module("digest_unrelated")
    importlib.import_module("digest_kit.extra")  # now an attribute of the package digest_models imports
    for rel in ("digest_unrelated.py", "digest_kit/extra.py", "venv/digest_vendored.py"):
        edit(rel)
        assert sources.code_digest("digest_models:net") == before, rel
    seen = {before}
    for rel in ("digest_layers.py", "digest_kit/heads.py", "digest_kit/__init__.py"):  # `import digest_kit.heads`
        edit(rel)
        digest = sources.code_digest("digest_models:net")
        assert digest not in seen, rel
        seen.add(digest)


def test_a_model_function_that_needs_an_argument_compress_does_not_pass_says_so(tmp_path, monkeypatch):
    import pytest

    from compress.errors import InputError

    (tmp_path / "bad_models.py").write_text(textwrap.dedent("""\
        import torch.nn as nn

        def needs_kwarg(num_classes, width):
            raise AssertionError("not called")

        def needs_two(num_classes, *, width, depth, image_size=(8, 8), **rest):
            raise AssertionError("not called")

        def has_defaults(num_classes, image_size, width=8):
            assert image_size == (8, 8)
            return nn.Linear(width, num_classes)
        """))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError) as e:
        build_model("bad_models:needs_kwarg", (1, 8, 8), 4)
    assert str(e.value) == (
        "model function 'bad_models:needs_kwarg' requires the argument 'width', which compress does not pass (it "
        "passes only num_classes, in_channels and image_size - a (height, width) tuple - to parameters of those "
        "names); give 'width' a default")
    with pytest.raises(InputError, match=r"requires the arguments 'width', 'depth', which .* give each of them a "):
        build_model("bad_models:needs_two", (1, 8, 8), 4)
    assert build_model("bad_models:has_defaults", (1, 8, 8), 4).out_features == 4
