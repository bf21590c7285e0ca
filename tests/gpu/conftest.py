"""GPU tests run only where CuPy and a CUDA device exist; everywhere else (CI included) they are skipped."""
from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

_HERE = Path(__file__).resolve().parent


def cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_ok():
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA device")
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def cb():
    """The CUDA backend (imported here, not at module level, so that collection works without CuPy)."""
    from cudflash.backends.cuda_backend import CudaBackend

    return CudaBackend()


@pytest.fixture
def rng(request) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))  # fresh per test, reproducible
