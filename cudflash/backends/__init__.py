"""Backend selection. CuPy is imported only when the cuda backend is asked for (or `auto` finds a device)."""
from __future__ import annotations

from typing import Any

from cudflash.backends.base import AttentionMeta, Backend, DeferredNorm, build_meta
from cudflash.backends.tuning import CudaTuning, as_tuning
from cudflash.errors import BackendError

__all__ = ["AttentionMeta", "Backend", "CudaTuning", "DeferredNorm", "build_meta", "get_backend", "cuda_available"]


def cuda_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: all mean "use the CPU"
        return False


def get_backend(name: str = "auto", tuning: CudaTuning | dict[str, Any] | None = None) -> Backend:
    """The backend called `name` (auto: cuda where a device is, else cpu). `tuning` (a CudaTuning or a dict of its
    fields) configures the cuda backend; the cpu backend has nothing to tune and refuses one that differs from the
    defaults, so a tuning asked for is never silently not applied."""
    tuning = as_tuning(tuning)
    if name == "auto":
        name = "cuda" if cuda_available() else "cpu"
    if name == "cpu":
        changed = tuning.changed()
        if changed:
            raise BackendError(f"the tuning sets {', '.join(changed)}, which only the cuda backend has (backend is "
                               "cpu)")
        from cudflash.backends.numpy_backend import NumpyBackend
        return NumpyBackend()
    if name == "cuda":
        if not cuda_available():
            raise BackendError("backend 'cuda' needs CuPy and a CUDA device (pip install 'cudflash[cuda12]' or "
                               "'[cuda13]')")
        try:
            from cudflash.backends.cuda_backend import CudaBackend
        except ImportError:
            raise BackendError("backend 'cuda' is not available in this build") from None
        return CudaBackend(tuning)
    raise BackendError(f"unknown backend '{name}' (expected auto, cpu or cuda)")
