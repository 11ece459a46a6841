"""Deployment: running an exported ONNX file with onnxruntime, numpy and Pillow - reading its metadata,
preprocessing image files exactly as validation did (`imageio`), predicting, timing (`latency`).

May import: compress.errors, compress.fileio, onnx, onnxruntime, numpy, Pillow. Never torch, and nothing else
of compress: a deployment needs only this package and the file."""
