"""What this machine runs natively: precision and speed advice depend on it.

Measured: on an AVX2-only AMD EPYC a bf16 (or fp16) matmul ran at ~1 GFLOP/s against ~130 in fp32, a bf16
Conv3d 165x slower than fp32, because torch emulates the narrow types there; on a Xeon with AMX bf16 ran
at 2,338 GFLOP/s against 374 in fp32. `capabilities()` is the one probe every rule in zoo.accel reads
(tests monkeypatch it to play another machine).
"""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["Capabilities", "CudaCapabilities", "capabilities", "cpu_class", "native_cpu_dtype", "slow_reason"]


@dataclass(frozen=True)
class CudaCapabilities:
    name: str
    compute_capability: tuple[int, int]
    bf16: bool  # bf16 tensor cores (sm80 on); before that torch emulates bf16
    fp16: bool  # fp16 tensor cores (sm70 on)
    tf32: bool  # TF32 tensor cores for fp32 matmuls (sm80 on)


@dataclass(frozen=True)
class Capabilities:
    cpu_class: str  # "AMX", "AVX-512-BF16", "AVX-512", "AVX2", else torch's name ("DEFAULT", "NEON", ...)
    cpu_bf16: bool  # native bf16 matmuls and convolutions: AVX512-BF16 or AMX
    cpu_fp16: bool  # native fp16 matmuls: AMX-FP16
    vnni: bool  # int8 dot-product instructions: AVX512-VNNI or AVX-VNNI (the int8 kernels' fast path)
    cpu_flags: frozenset[str] = field(default=frozenset(), repr=False)  # /proc/cpuinfo's (empty off Linux)
    cuda: tuple[CudaCapabilities, ...] = ()  # one entry per visible GPU (empty when not probed)

    def native(self, device: str | torch.device, dtype: torch.dtype) -> bool:
        """True where `device` has fast kernels for `dtype` matmuls and convolutions (fp32 always)."""
        device = torch.device(device)
        if dtype == torch.float32:
            return True
        if device.type == "cpu":
            return {torch.bfloat16: self.cpu_bf16, torch.float16: self.cpu_fp16}.get(dtype, False)
        if device.type == "cuda" and self.cuda:
            gpu = self.cuda[device.index if device.index is not None else torch.cuda.current_device()]
            return {torch.bfloat16: gpu.bf16, torch.float16: True}.get(dtype, False)
        return True  # other devices (mps, xpu, ...): no rule here, their own autocast decides

    def describe(self) -> str:
        """One line for benchmark headers and warnings, e.g. "CPU AVX2 (no native bf16, no VNNI)"."""
        native = [n for n, ok in (("bf16", self.cpu_bf16), ("fp16", self.cpu_fp16)) if ok]
        line = (f"CPU {self.cpu_class} ({'native ' + '/'.join(native) if native else 'no native bf16'}, "
                f"{'VNNI' if self.vnni else 'no VNNI'})")
        for gpu in self.cuda:
            kinds = [n for n, ok in (("bf16", gpu.bf16), ("fp16", gpu.fp16), ("TF32", gpu.tf32)) if ok]
            line += f"; GPU {gpu.name} sm{gpu.compute_capability[0]}{gpu.compute_capability[1]} ({'/'.join(kinds)})"
        return line


def _cpuinfo_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo ("flags" on x86, "Features" on Arm); empty elsewhere."""
    path = Path("/proc/cpuinfo")
    if platform.system() != "Linux" or not path.is_file():
        return frozenset()
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def _cpu() -> Capabilities:
    flags = _cpuinfo_flags()
    amx = torch.cpu._is_amx_tile_supported()
    avx512_bf16 = torch.cpu._is_avx512_bf16_supported()
    if amx:
        name = "AMX"
    elif avx512_bf16:
        name = "AVX-512-BF16"
    elif torch.cpu._is_avx512_supported():
        name = "AVX-512"
    elif torch.cpu._is_avx2_supported():
        name = "AVX2"
    else:
        name = torch.backends.cpu.get_cpu_capability()
    # torch probes AVX512-VNNI only; AVX-VNNI (the 256-bit form on AVX2 CPUs such as Alder Lake, Zen 5) is a flag
    vnni = torch.cpu._is_vnni_supported() or bool(flags & {"avx512_vnni", "avx_vnni"})
    return Capabilities(cpu_class=name, cpu_bf16=amx or avx512_bf16, cpu_fp16=torch.cpu._is_amx_fp16_supported(),
                        vnni=vnni, cpu_flags=flags)


@functools.cache
def _cuda() -> tuple[CudaCapabilities, ...]:
    if not torch.cuda.is_available():
        return ()
    gpus = []
    for i in range(torch.cuda.device_count()):
        cc = torch.cuda.get_device_capability(i)
        gpus.append(CudaCapabilities(name=torch.cuda.get_device_name(i), compute_capability=cc,
                                     bf16=cc >= (8, 0), fp16=cc >= (7, 0), tf32=cc >= (8, 0)))
    return tuple(gpus)


def capabilities(*, cuda: bool = True) -> Capabilities:
    """This machine's CPU class and, with `cuda` (the default), each visible GPU's bf16/fp16/TF32 support.
    Probed once per process. `cuda=False` skips the GPU probe, which would create a CUDA context."""
    cpu = _cpu()
    if not cuda:
        return cpu
    return Capabilities(**{**vars(cpu), "cuda": _cuda()})


def cpu_class() -> str:
    """A short name of the CPU's vector class for reports, e.g. "AMX (bf16 native)" or "AVX2"."""
    caps = capabilities(cuda=False)
    return caps.cpu_class + (" (bf16 native)" if caps.cpu_bf16 else "")


def native_cpu_dtype(dtype: torch.dtype) -> bool:
    """True where this CPU has kernels for `dtype` matmuls and convolutions (fp32 always; bf16 with
    AVX512-BF16 or AMX; fp16 with AMX-FP16); elsewhere torch emulates them, 100x slower or worse."""
    return capabilities(cuda=False).native("cpu", dtype)


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def slow_reason(device: str | torch.device, dtype: torch.dtype, caps: Capabilities | None = None) -> str:
    """Why `dtype` is slow on `device`, with the measured figure, for warnings and skipped benchmark rows."""
    device = torch.device(device)
    name = _DTYPE_NAMES.get(dtype, str(dtype))
    if device.type == "cuda":
        caps = caps or capabilities()
        gpu = caps.cuda[device.index or 0] if caps.cuda else None
        where = f"{gpu.name} (sm{gpu.compute_capability[0]}{gpu.compute_capability[1]})" if gpu else "this GPU"
        return f"{name} on {where} has no tensor cores for it (sm80 and later have); torch emulates it"
    caps = caps or capabilities(cuda=False)
    needs = "AVX512-BF16 or AMX" if dtype == torch.bfloat16 else "AMX-FP16"
    if caps.cpu_class == "AVX2":
        # measured in one process on an AVX2-only EPYC: ~1 GFLOP/s against ~130 in fp32 (bench/amp_fallback.py)
        return (f"{name} matmuls on this AVX2 CPU run ~100x slower than fp32 (emulated without {needs}; "
                f"measured ~1 vs ~130 GFLOP/s)")
    return f"{name} matmuls on this {caps.cpu_class} CPU are emulated (no {needs}) and run slower than fp32"
