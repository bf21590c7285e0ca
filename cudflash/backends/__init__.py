"""Backend selection. CuPy is imported only when the cuda backend is asked for (or `auto` finds a device)."""
from __future__ import annotations

from cudflash.backends.base import AttentionMeta, Backend, build_meta
from cudflash.errors import BackendError

__all__ = ["AttentionMeta", "Backend", "build_meta", "get_backend", "cuda_available"]


def cuda_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: all mean "use the CPU"
        return False


def get_backend(name: str = "auto") -> Backend:
    if name == "auto":
        name = "cuda" if cuda_available() else "cpu"
    if name == "cpu":
        from cudflash.backends.numpy_backend import NumpyBackend
        return NumpyBackend()
    if name == "cuda":
        if not cuda_available():
            raise BackendError("backend 'cuda' needs CuPy and a CUDA device (pip install 'cudflash[cuda12]' or '[cuda13]')")
        try:
            from cudflash.backends.cuda_backend import CudaBackend
        except ImportError:
            raise BackendError("backend 'cuda' is not available in this build") from None
        return CudaBackend()
    raise BackendError(f"unknown backend '{name}' (expected auto, cpu or cuda)")
