"""Safetensors checkpoints read without torch: header parse, memory map, sharded index, clear errors.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`, then the data area; offsets
are relative to the data area. Tensors are returned as read-only views into a memory map, so a checkpoint is
never copied whole into Python memory; BF16 (which numpy lacks) is exposed as its raw uint16 bits.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cudflash.errors import CheckpointError

# safetensors dtype -> numpy storage dtype (BF16 kept as raw bits, float8 as raw bytes). Every dtype a real
# checkpoint may hold is listed so that its header parses; only FLOAT_DTYPES can be read as weights.
STORAGE_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(np.uint16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(np.uint8),
    "F8_E5M2": np.dtype(np.uint8),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
FLOAT_DTYPES = ("BF16", "F16", "F32")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors spelling: BF16, F16, F32, ...
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset in the file
    nbytes: int


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key '{key}'")
        out[key] = value
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SafetensorsFile:
    """One safetensors file: its header parsed and checked at open, its data memory-mapped on first read.

    Checked at open (each fault is a one-line CheckpointError naming the file): file shorter than 8 bytes,
    header length over 100 MiB or past the end of the file, header not a JSON object (or with duplicate
    names), malformed entries, unknown dtype, negative dimensions, data_offsets whose size does not match
    dtype x shape, offsets past the end of the file, tensors whose byte ranges overlap.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path
        if not path.is_file():
            raise CheckpointError(f"{path}: missing safetensors file")
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path}: truncated file ({file_size} bytes; a safetensors file starts with an 8-byte header length)"
                )
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{path}: corrupt header length field ({header_len} bytes, over the {MAX_HEADER_BYTES}-byte "
                    f"limit; not a safetensors file?)"
                )
            if header_len > file_size - 8:
                raise CheckpointError(
                    f"{path}: truncated or corrupt header (length field says {header_len} bytes, "
                    f"only {file_size - 8} follow)"
                )
            raw = f.read(header_len)
        try:
            header = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupt header (not valid JSON)") from None
        except ValueError as e:  # duplicate key
            raise CheckpointError(f"{path}: corrupt header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt header (not a JSON object)")
        data_start = 8 + header_len
        data_size = file_size - data_start
        self.metadata: dict = header.get("__metadata__") if isinstance(header.get("__metadata__"), dict) else {}
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
                begin, end = offsets
                if not (isinstance(shape, list) and all(_is_int(d) for d in shape) and _is_int(begin) and _is_int(end)):
                    raise TypeError
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(
                    f"{path}: corrupt header entry for tensor '{name}' (expected dtype, shape [ints] and "
                    f"data_offsets [begin, end])"
                ) from None
            shape = tuple(shape)
            if dtype not in STORAGE_DTYPES:
                raise CheckpointError(f"{path}: tensor '{name}' has unknown dtype {dtype!r}")
            if any(d < 0 for d in shape):
                raise CheckpointError(f"{path}: tensor '{name}' has a negative dimension in shape {list(shape)}")
            expected = math.prod(shape) * STORAGE_DTYPES[dtype].itemsize
            if not 0 <= begin <= end or end - begin != expected:
                raise CheckpointError(
                    f"{path}: tensor '{name}' data_offsets [{begin}, {end}] hold {end - begin} bytes, but "
                    f"{dtype}{list(shape)} needs {expected}"
                )
            if end > data_size:
                raise CheckpointError(
                    f"{path}: tensor '{name}' data_offsets [{begin}, {end}] run past the end of the file "
                    f"(data area has {data_size} bytes; truncated?)"
                )
            self.tensors[name] = TensorInfo(name, dtype, shape, path, data_start + begin, end - begin)
        # Byte ranges must not overlap (empty tensors occupy nothing and are exempt).
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values() if t.nbytes)
        for (_, prev_end, prev_name), (begin, _, name) in zip(spans, spans[1:]):
            if begin < prev_end:
                raise CheckpointError(
                    f"{path}: tensors '{prev_name}' and '{name}' have overlapping data_offsets (corrupt header)"
                )
        self._map: np.memmap | None = None

    def array(self, info: TensorInfo) -> np.ndarray:
        """A read-only view of the tensor's bytes in its storage dtype (no copy)."""
        dtype = STORAGE_DTYPES[info.dtype]
        if info.nbytes == 0:  # nothing to map (an empty file region cannot be memory-mapped)
            empty = np.zeros(info.shape, dtype=dtype)
            empty.flags.writeable = False
            return empty
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        flat = np.frombuffer(self._map, dtype=dtype, count=info.nbytes // dtype.itemsize, offset=info.offset)
        return flat.reshape(info.shape)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) -> float32 values (exact: bf16 is the top half of a float32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Checkpoint:
    """All tensors of one model directory: `model.safetensors`, or shards listed in `model.safetensors.index.json`.

    Without either, every `*.safetensors` file in the directory is read (a tensor name in two files is an
    error). Only headers are read here; tensor data is memory-mapped when first asked for.
    """

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory")
        index = self.dir / INDEX_NAME
        files: dict[Path, SafetensorsFile] = {}
        self._where: dict[str, SafetensorsFile] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                    raise TypeError
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
                raise CheckpointError(
                    f"{index}: corrupt index (expected a JSON object with 'weight_map': {{tensor: file}})"
                ) from None
            for name, fname in weight_map.items():
                fpath = self.dir / fname
                if fpath not in files:
                    if not fpath.is_file():
                        raise CheckpointError(f"{fpath}: missing shard file (listed in {index.name} for '{name}')")
                    files[fpath] = SafetensorsFile(fpath)
                if name not in files[fpath].tensors:
                    raise CheckpointError(f"{fpath}: missing tensor '{name}' (listed in {index.name})")
                self._where[name] = files[fpath]
        else:
            single = self.dir / SINGLE_NAME
            paths = [single] if single.is_file() else sorted(self.dir.glob("*.safetensors"))
            if not paths:
                other = sorted(p.name for p in self.dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
                hint = f" (found {', '.join(other[:3])}; only safetensors is supported)" if other else ""
                raise CheckpointError(f"{self.dir}: no {SINGLE_NAME} or {INDEX_NAME}{hint}")
            for fpath in paths:
                sf = SafetensorsFile(fpath)
                for name in sf.tensors:
                    if name in self._where:
                        raise CheckpointError(
                            f"{fpath}: tensor '{name}' is also in {self._where[name].path.name} (ambiguous checkpoint)"
                        )
                    self._where[name] = sf

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        if name not in self._where:
            files = sorted({sf.path.name for sf in self._where.values()})
            where = files[0] if len(files) == 1 else f"{len(files)} files"
            raise CheckpointError(f"{self.dir}: missing tensor '{name}' (not in {where})")
        return self._where[name].tensors[name]

    def raw(self, name: str, shape: tuple[int, ...] | None = None) -> tuple[str, np.ndarray]:
        """(dtype, read-only storage view) of a floating tensor, after checking its shape and dtype."""
        info = self.info(name)
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(
                f"{info.file}: tensor '{name}' has shape {list(info.shape)}, expected {list(shape)}"
            )
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{info.file}: tensor '{name}' has dtype {info.dtype}, expected a float weight "
                f"({', '.join(FLOAT_DTYPES)})"
            )
        return info.dtype, self._where[name].array(info)

    def float32(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor as a float32 array (a new array; BF16 and F16 converted exactly)."""
        dtype, arr = self.raw(name, shape)
        if dtype == "BF16":
            return bf16_bits_to_float32(arr)
        return arr.astype(np.float32)
