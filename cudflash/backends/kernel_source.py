"""The CUDA sources: where they are, and each `kernels/<name>.cu` as NVRTC gets it. No CuPy here.

The sources are package data, read through importlib.resources Traversables (a folder on disk or an entry of a
zip archive alike): an installed wheel holds them as `cudflash/kernels/`; a source checkout or an editable install
has them in the top-level `kernels/` beside the package. A tuning's `kernel_dir` replaces both.

Local `#include "x.cuh"` lines are inlined here rather than passed as `-I`: CuPy's on-disk kernel cache is keyed
by the source text, so an inlined header that changes also changes the key (with `-I`, an edited header would
silently reuse a stale cubin). `#line` directives keep NVRTC's error messages pointing at the real file and line.
"""
from __future__ import annotations

import functools
import importlib.resources
import re
from importlib.resources.abc import Traversable
from pathlib import Path

from cudflash.errors import BackendError

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_MARKER = "common.cuh"  # every kernel includes it: the folder that holds it holds the sources


@functools.cache
def kernel_root(kernel_dir: str | None = None) -> Traversable:
    """The folder of the CUDA sources: `kernel_dir` if given, else the installed package's, else the checkout's."""
    if kernel_dir is not None:
        return Path(kernel_dir).resolve()
    packaged = importlib.resources.files("cudflash").joinpath("kernels")
    if packaged.joinpath(_MARKER).is_file():
        return packaged
    checkout = Path(__file__).resolve().parents[2] / "kernels"
    if (checkout / _MARKER).is_file():
        return checkout
    raise BackendError(f"cannot find the CUDA sources: neither {packaged} nor {checkout} holds {_MARKER}")


def module_names(kernel_dir: str | None = None) -> tuple[str, ...]:
    """The names of the compilable modules (`<name>.cu`), sorted."""
    return tuple(sorted(p.name[:-3] for p in kernel_root(kernel_dir).iterdir() if p.name.endswith(".cu")))


def copy_sources(folder: Path, replaced: dict[str, str] | None = None) -> str:
    """Copies the CUDA sources (`*.cu`, `*.cuh`) into `folder`, which must not exist yet, with the text of the files
    named in `replaced` ({file name: text}) instead of theirs: a tuning's kernel_dir for an A/B of kernel code.
    Returns the folder as a string."""
    folder.mkdir()
    replaced = replaced or {}
    for item in kernel_root().iterdir():
        if item.name.endswith((".cu", ".cuh")):
            text = replaced.get(item.name, item.read_text(encoding="utf-8"))
            (folder / item.name).write_text(text, encoding="utf-8")
    return str(folder)


def _expand(root: Traversable, parts: tuple[str, ...], seen: set[tuple[str, ...]]) -> str:
    """The text of root/parts with its local includes inlined (each at most once, like #pragma once); an include
    is relative to the folder of the file that has it."""
    file = root.joinpath(*parts)
    if not file.is_file():
        raise BackendError(f"CUDA source {file} not found")
    out = [f'#line 1 "{file}"']
    for lineno, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip() == "#pragma once":  # inlined once by construction; NVRTC warns about it in the main file
            out.append("")
            continue
        m = _INCLUDE.match(line)
        if not m:
            out.append(line)
            continue
        dep = _join(parts[:-1], m.group(1), file)
        if dep not in seen:
            seen.add(dep)
            out.append(_expand(root, dep, seen))
        out.append(f'#line {lineno + 1} "{file}"')
    return "\n".join(out) + "\n"


def _join(folder: tuple[str, ...], include: str, where: Traversable) -> tuple[str, ...]:
    """folder / include as parts below the root, `..` and `.` resolved."""
    parts = list(folder)
    for piece in include.split("/"):
        if piece == "..":
            if not parts:
                raise BackendError(f'{where}: #include "{include}" leaves the kernel folder')
            parts.pop()
        elif piece not in ("", "."):
            parts.append(piece)
    return tuple(parts)


@functools.cache
def source(name: str, kernel_dir: str | None = None) -> str:
    """The full NVRTC source of `<name>.cu`, headers inlined."""
    return _expand(kernel_root(kernel_dir), (f"{name}.cu",), set())
