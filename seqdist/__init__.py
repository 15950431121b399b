"""Differentiable distributions over sequences (CTC, CTC-CRF, RNN-T) and the fused kernels that make them fast, on CPU and GPU"""

__version__ = "0.1.0"
