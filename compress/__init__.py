"""compress: train a teacher, distill a student, quantize it, ship verified int8 ONNX."""

__version__ = "0.1.0"
