"""Gradient compression for the torch adapter: ``Compression.none``, ``.fp16`` and ``.bf16``.

A compressor turns a tensor into the tensor that travels (``compress`` → ``(tensor, ctx)``) and back
(``decompress(tensor, ctx)``).  Only floating-point tensors are cast; others pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class Compressor:
    """Interface for compressing and decompressing a given tensor."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Compresses a tensor and returns it with the context needed to decompress it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Decompress the tensor with the given context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Default: send tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None or tensor.dtype == ctx else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Cast floating-point tensors to float16 for the wire (halves the bytes; 5e-4 relative precision)."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Cast floating-point tensors to bfloat16: float32's range (no overflow), 8 bits of mantissa."""

    wire_dtype = torch.bfloat16


class Compression:
    """Optional gradient compression algorithm used during allreduce."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
