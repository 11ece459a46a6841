"""Deployment: running an exported ONNX file with onnxruntime, numpy and Pillow - reading its metadata,
preprocessing image files exactly as validation did (`imageio`), predicting and evaluating (`evaluate`), timing
it in the registered runtimes by one protocol (`runtimes`, `timing`, `latency`), and reading the export stage's
export.json in its typed schema (`export_report`).

May import: compress.errors, compress.fileio, compress.cpus, onnx, onnxruntime, numpy, Pillow. Never torch, and
nothing else of compress: a deployment needs only this package and the file."""
