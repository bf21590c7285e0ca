"""Safetensors checkpoints read without torch: header parse, memory map, sharded index, clear errors.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`, then the data area; offsets
are relative to the data area. Tensors are returned as read-only views into a memory map, so a checkpoint is
never copied whole into Python memory; BF16 (which numpy lacks) is exposed as its raw uint16 bits.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cudflash.errors import CheckpointError
from cudflash.model_files import (JSONError, UnsafeFileError, open_regular, parse_json, read_bounded,
                                  resolve_inside, shown)

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
QUANT_DTYPES = ("F8_E4M3", "U8")  # quantized weights and their scales: packed codes, read by cudflash.quant
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
MAX_HEADER_DEPTH = 3  # {name: {"shape": [...]}}: the format nests nothing deeper
MAX_INDEX_BYTES = 64 * 1024 * 1024  # an index of 100k tensors takes about 10 MB
MAX_NDIM = 32  # numpy's own bound on dimensions
MAX_ELEMENTS_BYTES = 2**62  # no shape may claim more bytes (numpy refuses larger arrays, even empty ones)
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_ENTRY_FIELDS = ("dtype", "shape", "data_offsets")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors spelling: BF16, F16, F32, ...
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset in the file
    nbytes: int


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SafetensorsFile:
    """One safetensors file: its header parsed and checked at open, its bytes memory-mapped (never read whole).

    The format: an 8-byte little-endian header length N, N bytes of JSON (an object, padded at the end with
    spaces only), then the data area. Checked at open, each fault a one-line CheckpointError naming the file: a
    file shorter than 8 bytes, N over 100 MiB or past the end of the file, a header that is not exactly one
    UTF-8 JSON object of `{name: {dtype, shape, data_offsets}}` and an optional `__metadata__` map of strings
    (no duplicate names, no other fields, nesting bounded), unknown dtypes, shapes that are not lists of
    non-negative integers, data_offsets whose size is not dtype size x shape, and tensors that do not tile the
    data area exactly (no overlap, no gap, no byte after the last). A file that shrinks while open is refused
    at the next read instead of faulting on the missing pages (SIGBUS).
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path
        try:
            f = open_regular(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing safetensors file") from None
        except UnsafeFileError as e:
            raise CheckpointError(f"{path}: {e}, not a safetensors file") from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read the file ({e.strerror})") from None
        with f:
            self.file_size = file_size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path}: truncated file ({file_size} bytes; a safetensors file starts with an 8-byte header length)"
                )
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER_BYTES:  # the value is not shown: it is 8 bytes of whatever the file holds
                raise CheckpointError(
                    f"{path}: corrupt header length field (over the {MAX_HEADER_BYTES}-byte limit; not a "
                    f"safetensors file?)"
                )
            if header_len > file_size - 8:
                raise CheckpointError(
                    f"{path}: truncated or corrupt header (length field says {header_len} bytes, "
                    f"only {file_size - 8} follow)"
                )
            raw = f.read(header_len)
            # Mapped now, from the descriptor the header came from: the data belongs to the same file.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._check_size()
        header = self._parse_header(raw)
        self.data_start = 8 + header_len
        data_size = file_size - self.data_start
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CheckpointError(f"{path}: corrupt header ('__metadata__' should map strings to strings)")
        self.metadata: dict[str, str] = metadata
        self.tensors: dict[str, TensorInfo] = {name: self._entry(name, entry, data_size)
                                               for name, entry in header.items()}
        self._check_tiling(data_size)

    def _parse_header(self, raw: bytes) -> dict:
        if not raw.startswith(b"{"):
            raise CheckpointError(f"{self.path}: corrupt header (not a JSON object)")
        body = raw.rstrip(b" ")  # the only padding the format allows
        if not body.endswith(b"}"):
            raise CheckpointError(f"{self.path}: corrupt header (the JSON object does not end where the length "
                                  f"field says, less space padding)")
        try:
            return parse_json(body, max_depth=MAX_HEADER_DEPTH)
        except JSONError as e:
            raise CheckpointError(f"{self.path}: corrupt header ({e})") from None

    def _entry(self, name: str, entry: object, data_size: int) -> TensorInfo:
        where = f"{self.path}: tensor {shown(name)}"
        if not isinstance(entry, dict) or sorted(entry) != sorted(_ENTRY_FIELDS):
            raise CheckpointError(f"{self.path}: corrupt header entry for tensor {shown(name)} (expected exactly "
                                  f"dtype, shape [ints] and data_offsets [begin, end])")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in STORAGE_DTYPES:
            what = shown(dtype) if isinstance(dtype, str) else f"of type {type(dtype).__name__}"
            raise CheckpointError(f"{where} has unknown dtype {what} (expected one of {', '.join(STORAGE_DTYPES)})")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(d) for d in shape):
            raise CheckpointError(f"{self.path}: corrupt header entry for tensor {shown(name)} (shape should be a "
                                  f"list of at most {MAX_NDIM} integers)")
        if any(d < 0 for d in shape):
            raise CheckpointError(f"{where} has a negative dimension in shape {shape}")
        itemsize = STORAGE_DTYPES[dtype].itemsize
        if math.prod(max(d, 1) for d in shape) * itemsize > MAX_ELEMENTS_BYTES:
            raise CheckpointError(f"{where} has shape {shape}, larger than any file can hold")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise CheckpointError(f"{self.path}: corrupt header entry for tensor {shown(name)} (data_offsets "
                                  f"should be [begin, end], two integers)")
        begin, end = offsets
        expected = math.prod(shape) * itemsize
        if not 0 <= begin <= end or end - begin != expected:
            raise CheckpointError(
                f"{where} data_offsets [{begin}, {end}] hold {end - begin} bytes, but {dtype}{shape} needs {expected}"
            )
        if end > data_size:
            raise CheckpointError(
                f"{where} data_offsets [{begin}, {end}] run past the end of the file (data area has {data_size} "
                f"bytes; truncated?)"
            )
        return TensorInfo(name, dtype, tuple(shape), self.path, self.data_start + begin, end - begin)

    def _check_tiling(self, data_size: int) -> None:
        """The tensors, in offset order, cover the data area exactly: each begins where the one before ends
        (empty tensors too), and the last ends at the end of the file (the format's rule: no holes)."""
        cursor, before = 0, None
        for info in sorted(self.tensors.values(), key=lambda t: (t.offset, t.offset + t.nbytes)):
            begin = info.offset - self.data_start
            if begin < cursor:
                raise CheckpointError(f"{self.path}: tensors {shown(before)} and {shown(info.name)} have "
                                      f"overlapping data_offsets (corrupt header)")
            if begin > cursor:
                raise CheckpointError(f"{self.path}: data area has a gap of {begin - cursor} bytes before tensor "
                                      f"{shown(info.name)} (corrupt header)")
            cursor, before = begin + info.nbytes, info.name
        if cursor != data_size:
            raise CheckpointError(f"{self.path}: {data_size - cursor} bytes after the last tensor (the data area "
                                  f"has {data_size} bytes, its tensors cover {cursor}: a wrong header length "
                                  f"field, or trailing data)")

    def _check_size(self, info: TensorInfo | None = None) -> None:
        """The mapped file still has the size it had at open (mmap.size() asks the kernel): reading the pages
        of a file truncated under the map would kill the process."""
        size = self._map.size()
        if size < self.file_size:
            what = f" before tensor {shown(info.name)} was read" if info is not None else ""
            raise CheckpointError(f"{self.path}: file shrank from {self.file_size} to {size} bytes while open{what} "
                                  f"(modified during the load?)")

    def array(self, info: TensorInfo) -> np.ndarray:
        """A read-only view of the tensor's bytes in its storage dtype (no copy)."""
        dtype = STORAGE_DTYPES[info.dtype]
        if info.nbytes == 0:  # nothing to map
            empty = np.zeros(info.shape, dtype=dtype)
            empty.flags.writeable = False
            return empty
        self._check_size(info)
        flat = np.frombuffer(self._map, dtype=dtype, count=info.nbytes // dtype.itemsize, offset=info.offset)
        return flat.reshape(info.shape)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) -> float32 values (exact: bf16 is the top half of a float32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Checkpoint:
    """All tensors of one model directory: `model.safetensors`, or shards listed in `model.safetensors.index.json`.

    Without either, every `*.safetensors` file in the directory is read (a tensor name in two files is an
    error). Every file must resolve inside the directory (model_files.resolve_inside). With an index, the index
    and the shards must agree exactly: each listed shard exists and holds the tensors listed for it, and no
    shard holds a tensor the index does not list for it. Only headers are read here; tensor data is
    memory-mapped and read when asked for.
    """

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory")
        self._where: dict[str, SafetensorsFile] = {}
        if (self.dir / INDEX_NAME).is_file() or (self.dir / INDEX_NAME).is_symlink():
            self._read_index(self._inside(INDEX_NAME, f"{self.dir}: {INDEX_NAME}"))
            return
        single = self.dir / SINGLE_NAME
        paths = [single] if single.is_file() or single.is_symlink() else sorted(self.dir.glob("*.safetensors"))
        if not paths:
            other = sorted(p.name for p in self.dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
            hint = f" (found {', '.join(other[:3])}; only safetensors is supported)" if other else ""
            raise CheckpointError(f"{self.dir}: no {SINGLE_NAME} or {INDEX_NAME}{hint}")
        for fpath in paths:
            sf = SafetensorsFile(self._inside(fpath.name, str(fpath)))
            for name in sf.tensors:
                if name in self._where:
                    raise CheckpointError(f"{fpath}: tensor {shown(name)} is also in {self._where[name].path.name} "
                                          f"(ambiguous checkpoint)")
                self._where[name] = sf

    def _inside(self, name: object, what: str) -> Path:
        try:
            return resolve_inside(self.dir, name)
        except UnsafeFileError as e:
            raise CheckpointError(f"{what} is {e}: refusing to read outside {self.dir}") from None

    def _read_index(self, index: Path) -> None:
        shape_hint = "expected a JSON object with 'weight_map': {tensor: file}"
        try:
            doc = parse_json(read_bounded(index, MAX_INDEX_BYTES))
        except (JSONError, UnsafeFileError) as e:
            raise CheckpointError(f"{index}: corrupt index ({e}; {shape_hint})") from None
        except OSError as e:
            raise CheckpointError(f"{index}: cannot read the index ({e.strerror})") from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: corrupt index ({shape_hint})")
        if not weight_map:
            raise CheckpointError(f"{index}: corrupt index (its weight_map lists no tensors)")
        if not isinstance(doc.get("metadata", {}), (dict, type(None))):
            raise CheckpointError(f"{index}: corrupt index ('metadata' should be an object)")
        shards: dict[str, SafetensorsFile] = {}  # by the name the index uses
        real: dict[Path, SafetensorsFile] = {}  # two spellings of one file are one shard
        for name, fname in weight_map.items():
            if fname not in shards:
                fpath = self._inside(fname, f"{index}: shard {shown(fname)} (listed for tensor {shown(name)})")
                if not fpath.is_file():
                    raise CheckpointError(f"{fpath}: missing shard file (listed in {INDEX_NAME} for {shown(name)})")
                key = fpath.resolve()
                if key not in real:
                    real[key] = SafetensorsFile(fpath)
                shards[fname] = real[key]
            sf = shards[fname]
            if name not in sf.tensors:
                raise CheckpointError(f"{sf.path}: missing tensor {shown(name)} (listed in {INDEX_NAME})")
            self._where[name] = sf
        for sf in real.values():
            for name in sf.tensors:
                if self._where.get(name) is not sf:
                    listed = (f"lists it in {self._where[name].path.name}" if name in self._where
                              else "does not list it")
                    raise CheckpointError(f"{sf.path}: holds tensor {shown(name)} but {INDEX_NAME} {listed} "
                                          f"(index and shards disagree)")

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        if name not in self._where:
            files = sorted({sf.path.name for sf in self._where.values()})
            where = files[0] if len(files) == 1 else f"{len(files)} files"
            raise CheckpointError(f"{self.dir}: missing tensor {shown(name)} (not in {where})")
        return self._where[name].tensors[name]

    def array(self, name: str) -> np.ndarray:
        """A read-only view of any tensor in its storage dtype (integer tensors such as d2t included)."""
        return self._where[name].array(self.info(name))

    def raw(self, name: str, shape: tuple[int, ...] | None = None) -> tuple[str, np.ndarray]:
        """(dtype, read-only storage view) of a floating tensor, after checking its shape and dtype."""
        info = self.info(name)
        if info.dtype in QUANT_DTYPES:  # reached only where the checkpoint declares no quantization of this tensor
            raise CheckpointError(
                f"{info.file}: tensor {shown(name)} has dtype {info.dtype}, expected a float weight "
                f"({', '.join(FLOAT_DTYPES)}): a quantized tensor, but {self.dir / 'config.json'} declares no "
                f"quantization_config that covers it"
            )
        return self.typed(name, FLOAT_DTYPES, shape, "a float weight")

    def typed(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None = None,
              what: str = "") -> tuple[str, np.ndarray]:
        """(dtype, read-only storage view) of a tensor whose dtype is one of `dtypes`, after checking its shape."""
        info = self.info(name)
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(
                f"{info.file}: tensor {shown(name)} has shape {list(info.shape)}, expected {list(shape)}"
            )
        if info.dtype not in dtypes:
            raise CheckpointError(
                f"{info.file}: tensor {shown(name)} has dtype {info.dtype}, expected {what + ' ' if what else ''}"
                f"({', '.join(dtypes)})"
            )
        return info.dtype, self.array(name)

    def float32(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor as a float32 array (a new array; BF16 and F16 converted exactly)."""
        dtype, arr = self.raw(name, shape)
        if dtype == "BF16":
            return bf16_bits_to_float32(arr)
        return arr.astype(np.float32)
