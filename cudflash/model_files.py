"""The files of a model folder, read as untrusted input: names that must stay inside the folder, and JSON of
bounded size and nesting.

A checkpoint from anywhere names its own files (the shard names of `model.safetensors.index.json`) and may
hold symbolic links: nothing that resolves outside its folder is ever opened, so an error can never show a
byte of a file elsewhere. One layout links out by design: a Hugging Face hub cache snapshot
(`models--org--name/snapshots/<revision>/...`) links each file into its repository's `blobs/` folder, which
therefore counts as inside.
"""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, BinaryIO

import numpy as np

MAX_JSON_DEPTH = 64  # configs nest a few levels (rope_parameters, quantization_config, text_config)
MAX_INT_DIGITS = 64  # no field of a config or header needs more (Python's own limit is 4300 digits)


class UnsafeFileError(ValueError):
    """A file name that does not stay inside its folder; the message says why, never what the file holds."""


class JSONError(ValueError):
    """JSON refused: invalid, too deep, too large, or ambiguous (a duplicate key); a one-line reason."""


def shown(value: Any, limit: int = 80) -> str:
    """A value read from a file, quoted for a one-line message: repr (escapes shown), cut when long."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _roots(folder: Path) -> list[Path]:
    """The real folders a file of `folder` may resolve into: the folder, and a hub snapshot's blobs folder."""
    real = folder.resolve()
    roots = [real]
    parts = real.parts
    for i in range(len(parts) - 2, 0, -1):  # .../models--org--name/snapshots/<revision>[/sub/dirs]
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            roots.append(Path(*parts[:i]) / "blobs")
            break
    return roots


def resolve_inside(folder: Path, name: object) -> Path:
    """`folder / name` after checking that it stays inside `folder`: a relative name without '..', and no
    symbolic link on the way that leaves the folder (real paths compared). Raises UnsafeFileError."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UnsafeFileError("not a file name")
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive:
        raise UnsafeFileError("an absolute path")
    if ".." in PurePosixPath(name).parts or ".." in PureWindowsPath(name).parts:
        raise UnsafeFileError("a path with '..'")
    path = folder / name
    try:
        real = path.resolve()
    except (RuntimeError, OSError):  # a loop of links (RuntimeError before Python 3.13)
        raise UnsafeFileError("a loop of symbolic links") from None
    if not any(real.is_relative_to(root) for root in _roots(folder)):
        raise UnsafeFileError("a symbolic link that leaves the folder")
    return path


def open_regular(path: Path) -> BinaryIO:
    """The file opened for reading if it is a regular file (a FIFO or device is refused without blocking).
    Raises UnsafeFileError, or OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeFileError("not a regular file")
    return os.fdopen(fd, "rb")


def read_bounded(path: Path, max_bytes: int) -> bytes:
    """A regular file's bytes, refusing one of more than `max_bytes` (never reading more than one byte past).
    Raises UnsafeFileError, JSONError (too large) or OSError."""
    with open_regular(path) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise JSONError(f"larger than the {max_bytes >> 20} MiB limit")
    return data


# A JSON string token (escapes included), so that brackets inside strings are not counted as nesting.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _nesting_depth_over(text: str, limit: int) -> bool:
    """Whether the brackets outside strings nest deeper than `limit` (checked before parsing: the parser
    recurses per level)."""
    brackets = np.frombuffer(_NOT_BRACKET.sub("", _STRING.sub("", text)).encode("ascii"), dtype=np.uint8)
    depth = 0
    for lo in range(0, len(brackets), 1 << 20):
        chunk = brackets[lo:lo + (1 << 20)]
        steps = np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1).astype(np.int64)
        levels = np.cumsum(steps) + depth
        if levels.max() > limit:
            return True
        depth = int(levels[-1])
    return False


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise JSONError(f"duplicate key {shown(key)}")
        out[key] = value
    return out


def _bounded_int(literal: str) -> int:
    digits = len(literal.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise JSONError(f"an integer of {digits} digits")
    return int(literal)


def parse_json(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Strict JSON: UTF-8, nested at most `max_depth` levels, no duplicate keys, integers of sane length.
    Raises JSONError with a one-line reason that quotes nothing of the input but a duplicate key."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise JSONError(f"not UTF-8 (byte offset {e.start})") from None
    if _nesting_depth_over(text, max_depth):
        raise JSONError(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(text, object_pairs_hook=_object_without_duplicates, parse_int=_bounded_int)
    except json.JSONDecodeError as e:
        raise JSONError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except JSONError:
        raise
    except (ValueError, RecursionError) as e:  # a float literal too long to convert; nesting is bounded above
        raise JSONError(f"not valid JSON ({type(e).__name__})") from None
