"""What this machine's CPU runs natively: speed advice depends on it (on an AVX2-only CPU a bf16 matmul
ran at ~1 GFLOP/s against ~130 in fp32; with AMX bf16 is ~6x faster than fp32)."""
from __future__ import annotations

import torch

__all__ = ["cpu_class", "native_cpu_dtype"]


def cpu_class() -> str:
    """A short name of the CPU's vector class for reports, e.g. "AVX512 + AMX (bf16 native)" or "AVX2"."""
    name = torch.backends.cpu.get_cpu_capability()
    if torch.cpu._is_amx_tile_supported():
        name += " + AMX"
    if native_cpu_dtype(torch.bfloat16):
        name += " (bf16 native)"
    return name


def native_cpu_dtype(dtype: torch.dtype) -> bool:
    """True where this CPU has kernels for `dtype` matmuls and convolutions (fp32 always; bf16 with
    AVX512-BF16 or AMX; fp16 with AMX-FP16); elsewhere torch emulates them, 100x slower or worse."""
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if dtype == torch.float16:
        return torch.cpu._is_amx_fp16_supported()
    return False
