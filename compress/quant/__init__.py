"""Quantization and ONNX: FX quantization-aware training (`fx`), the latency-aware choice of layers kept in
float (`mixed_precision`), torch -> ONNX export (`onnx_export`) and its QDQ clean-up (`qdq`), and the checks
of an exported file against PyTorch (`verify`: parity, int8 kernels, speed).

May import: compress.errors, compress.fileio, compress.deploy, compress.training.checkpoint, torch, onnx,
onnxruntime."""
