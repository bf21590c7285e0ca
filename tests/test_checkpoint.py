"""Safetensors reading without torch: dtypes round-trip, memory mapping, shards, and one clear line per bad file."""
from __future__ import annotations

import json
import mmap
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from cudflash.checkpoint import MAX_HEADER_BYTES, Checkpoint, SafetensorsFile, bf16_bits_to_float32
from cudflash.errors import CheckpointError, CudflashError
from cudflash.tiny import (TinyShape, float32_to_bf16_bits, target_tensors, write_model, write_random_pair,
                           write_safetensors)
from tests.conftest import expect_error


# ---------------------------------------------------------------------------------------------- helpers

def write_raw(path: Path, header: dict | bytes, data: bytes = b"", header_len: int | None = None) -> Path:
    """A safetensors file byte by byte: any header (dict or raw bytes), any length field, any data."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head) if header_len is None else header_len))
        f.write(head)
        f.write(data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def bf16_round(x: np.ndarray) -> np.ndarray:
    return bf16_bits_to_float32(float32_to_bf16_bits(x))


def memmap_backed(arr: np.ndarray) -> bool:
    """Whether the array's memory is a file mapping (an mmap behind its chain of views and memoryviews)."""
    base = arr
    while base is not None:
        if isinstance(base, (np.memmap, mmap.mmap)):
            return True
        base = base.obj if isinstance(base, memoryview) else base.base
    return False


# ------------------------------------------------------------------------------------ dtype round trips

@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_float_dtypes_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(1)
    tensors = {
        "a.weight": rng.standard_normal((3, 5)).astype(np.float32),
        "b.weight": (rng.standard_normal(7) * 100).astype(np.float32),
        "c.weight": np.array([0.0, -0.0, 1.0, -2.5, 65504.0], dtype=np.float32),
        "d.weight": rng.standard_normal((2, 3, 4)).astype(np.float32),
    }
    write_safetensors(tmp_path / "model.safetensors", tensors, dtype)
    ckpt = Checkpoint(tmp_path)
    assert sorted(ckpt.names) == sorted(tensors)
    storage = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}[dtype]
    for name, x in tensors.items():
        got_dtype, raw = ckpt.raw(name, x.shape)
        assert got_dtype == dtype
        assert raw.dtype == storage and raw.shape == x.shape
        expected = {"BF16": bf16_round, "F16": lambda v: v.astype(np.float16).astype(np.float32),
                    "F32": lambda v: v}[dtype](x)
        got = ckpt.float32(name, x.shape)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_allclose(got, x, rtol={"BF16": 2**-8, "F16": 2**-10, "F32": 0}[dtype], atol=1e-3)
    # signed zero survives
    assert np.signbit(ckpt.float32("c.weight")[1])


def test_bf16_bits_known_values():
    bits = np.array([0x0000, 0x8000, 0x3F80, 0xC000, 0x7F80, 0xFF80, 0x3F81, 0x4049], dtype=np.uint16)
    got = bf16_bits_to_float32(bits)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got[:6], [0.0, -0.0, 1.0, -2.0, np.inf, -np.inf])
    assert got[6] == np.float32(1.0 + 2**-7)
    assert abs(got[7] - 3.140625) < 1e-7
    assert np.isnan(bf16_bits_to_float32(np.array([0x7FC0], dtype=np.uint16)))[0]


def test_bf16_write_rounds_to_nearest_even(tmp_path):
    # 1 + 2^-8 is exactly halfway between bf16 1.0 and 1 + 2^-7: ties to even -> 1.0
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20], dtype=np.float32)
    write_safetensors(tmp_path / "model.safetensors", {"x": x}, "BF16")
    got = Checkpoint(tmp_path).float32("x")
    np.testing.assert_array_equal(got, np.array([1.0, 1.0 + 2 * 2**-7, 1.0 + 2**-7], dtype=np.float32))


def test_unaligned_data_area_reads_correctly(tmp_path):
    """A header whose length is not a multiple of the element size still gives the right values."""
    x = np.arange(6, dtype=np.float32) * 1.5
    header = {"x": entry("F32", [2, 3], 0, 24)}
    head = json.dumps(header).encode() + b" "  # odd length
    assert (8 + len(head)) % 4 != 0
    write_raw(tmp_path / "model.safetensors", head, x.tobytes())
    np.testing.assert_array_equal(Checkpoint(tmp_path).float32("x", (2, 3)), x.reshape(2, 3))


def test_empty_and_scalar_tensors(tmp_path):
    write_safetensors(tmp_path / "model.safetensors",
                      {"empty": np.zeros((0, 4), np.float32), "scalar": np.array(3.0, np.float32)}, "F32")
    ckpt = Checkpoint(tmp_path)
    assert ckpt.float32("empty", (0, 4)).shape == (0, 4)
    assert ckpt.float32("scalar", ()) == 3.0


def test_metadata_is_not_a_tensor(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"x": np.ones(2, np.float32)}, "F32")
    sf = SafetensorsFile(tmp_path / "model.safetensors")
    assert list(sf.tensors) == ["x"]
    assert sf.metadata == {"format": "pt"}


# ----------------------------------------------------------------------------------------- memory map

def test_tensors_are_read_only_views_of_a_memory_map(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"w": np.ones((4, 4), np.float32)}, "BF16")
    _, raw = Checkpoint(tmp_path).raw("w", (4, 4))
    assert not raw.flags.owndata
    assert not raw.flags.writeable
    assert memmap_backed(raw)
    with pytest.raises(ValueError):
        raw[0, 0] = 0


def test_large_file_is_not_read_whole(tmp_path):
    """A 256 MiB (sparse) tensor: opening the checkpoint and reading one row allocates almost nothing."""
    rows, cols = 8192, 16384  # BF16: 256 MiB
    nbytes = rows * cols * 2
    path = write_raw(tmp_path / "model.safetensors", {"big": entry("BF16", [rows, cols], 0, nbytes)})
    with open(path, "r+b") as f:  # extend with a hole: no disk used, reads as zeros
        f.truncate(path.stat().st_size + nbytes)
        f.seek(-2, 2)
        f.write(struct.pack("<H", 0x3F80))  # the very last element is 1.0
    tracemalloc.start()
    try:
        ckpt = Checkpoint(tmp_path)
        dtype, raw = ckpt.raw("big", (rows, cols))
        last = bf16_bits_to_float32(raw[-1])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert dtype == "BF16" and raw.shape == (rows, cols)
    assert last[-1] == 1.0 and not last[:-1].any()
    assert peak < 8 * 1024 * 1024, f"peak traced allocation {peak} bytes: the file was read, not mapped"


# ------------------------------------------------------------------------------- real layouts (tiny.py)

@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("shards", [1, 3])
def test_target_checkpoints(tmp_path, arch, tied, shards):
    shape = TinyShape(arch=arch, tie_word_embeddings=tied, shards=shards, num_layers=2, target_layer_ids=[0, 1],
                      hidden_size=32, intermediate_size=48, vocab_size=64)
    target_dir, draft_dir = write_random_pair(tmp_path, shape, seed=3)
    expected = target_tensors(shape, np.random.default_rng(3))  # the same draws write_random_pair made
    index = target_dir / "model.safetensors.index.json"
    if shards > 1:
        files = sorted(p.name for p in target_dir.glob("*.safetensors"))
        assert len(files) == shards and not (target_dir / "model.safetensors").exists()
        assert set(json.loads(index.read_text())["weight_map"].values()) == set(files)
    else:
        assert not index.exists()
    ckpt = Checkpoint(target_dir)
    assert sorted(ckpt.names) == sorted(expected)
    assert ("lm_head.weight" in ckpt) == (not tied)
    attn = "model.layers.1.self_attn."
    assert (attn + "q_proj.bias" in ckpt) == (arch == "qwen2")
    assert (attn + "k_proj.bias" in ckpt) == (arch == "qwen2")
    assert (attn + "q_norm.weight" in ckpt) == (arch == "qwen3")
    for name, x in expected.items():
        np.testing.assert_array_equal(ckpt.float32(name, x.shape), bf16_round(x), err_msg=name)
    if shards > 1:  # tensors really are spread over the shards
        assert len({ckpt.info(n).file for n in ckpt.names}) == shards
    draft = Checkpoint(draft_dir)
    assert "fc.weight" in draft and draft.info("fc.weight").shape == (32, 2 * 32)
    assert not any(n.startswith("model.") for n in draft.names)  # z-lab drafters are unprefixed


def test_index_takes_precedence_and_ignores_unlisted_files(tmp_path):
    write_model(tmp_path, {}, {"a": np.ones(2, np.float32), "b": np.zeros(3, np.float32)}, "F32", shards=2)
    write_safetensors(tmp_path / "stray.safetensors", {"a": np.full(2, 7, np.float32)}, "F32")
    ckpt = Checkpoint(tmp_path)
    assert sorted(ckpt.names) == ["a", "b"]
    np.testing.assert_array_equal(ckpt.float32("a"), [1, 1])


def test_single_file_preferred_over_other_safetensors(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"a": np.ones(2, np.float32)}, "F32")
    write_safetensors(tmp_path / "consolidated.safetensors", {"a": np.zeros(2, np.float32)}, "F32")
    np.testing.assert_array_equal(Checkpoint(tmp_path).float32("a"), [1, 1])


# ------------------------------------------------------------------------------------- bad checkpoints

@pytest.fixture
def good_file(tmp_path) -> Path:
    write_safetensors(tmp_path / "model.safetensors",
                      {"w": np.ones((4, 8), np.float32), "ids": np.arange(6, dtype=np.int32)}, "native")
    return tmp_path / "model.safetensors"


def test_missing_tensor(good_file):
    with pytest.raises(CheckpointError) as e:
        Checkpoint(good_file.parent).raw("model.norm.weight", (8,))
    expect_error(e, str(good_file.parent), "missing tensor", "model.norm.weight")


def test_wrong_shape(good_file):
    with pytest.raises(CheckpointError) as e:
        Checkpoint(good_file.parent).raw("w", (8, 4))
    expect_error(e, str(good_file), "'w'", "[4, 8]", "[8, 4]")


def test_wrong_dtype_integer_where_float_expected(good_file):
    ckpt = Checkpoint(good_file.parent)
    assert ckpt.info("ids").dtype == "I32"
    with pytest.raises(CheckpointError) as e:
        ckpt.float32("ids", (6,))
    expect_error(e, str(good_file), "'ids'", "I32", "BF16")


def test_float8_tensor_parses_but_is_not_a_float_weight(tmp_path):
    data = np.ones(4, np.float32).tobytes() + bytes(4)
    write_raw(tmp_path / "model.safetensors", {"w": entry("F32", [4], 0, 16), "s": entry("F8_E4M3", [4], 16, 20)},
              data)
    ckpt = Checkpoint(tmp_path)
    np.testing.assert_array_equal(ckpt.float32("w"), np.ones(4))
    with pytest.raises(CheckpointError) as e:
        ckpt.raw("s")
    expect_error(e, "'s'", "F8_E4M3")


@pytest.mark.parametrize("keep", [4, 8 + 10, -1])
def test_truncated_file(good_file, keep):
    """Cut inside the length field, inside the header, and inside the data area."""
    blob = good_file.read_bytes()
    good_file.write_bytes(blob[:keep])
    with pytest.raises(CheckpointError) as e:
        Checkpoint(good_file.parent)
    msg = expect_error(e, str(good_file))
    assert "truncated" in msg
    if keep == -1:
        assert "'ids'" in msg and "past the end" in msg  # the last tensor lost a byte


def test_empty_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(tmp_path / "model.safetensors"), "truncated", "0 bytes")


@pytest.mark.parametrize("head", [b"{not json", b"\xff\xfe\x00{}", b"", b"{\"x\": "])
def test_corrupt_header_bad_json(tmp_path, head):
    path = write_raw(tmp_path / "model.safetensors", head, bytes(16))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(path), "corrupt header", "JSON")


def test_header_not_an_object(tmp_path):
    path = write_raw(tmp_path / "model.safetensors", b"[1, 2, 3]")
    with pytest.raises(CheckpointError) as e:
        SafetensorsFile(path)
    expect_error(e, str(path), "not a JSON object")


def test_header_longer_than_file(tmp_path):
    path = write_raw(tmp_path / "model.safetensors", {"x": entry("F32", [1], 0, 4)}, bytes(4), header_len=4096)
    size = path.stat().st_size
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(path), "4096", str(size - 8))


def test_header_over_100_mib(tmp_path):
    huge = MAX_HEADER_BYTES + 1
    path = write_raw(tmp_path / "model.safetensors", b"{}", header_len=huge)
    with pytest.raises(CheckpointError) as e:
        SafetensorsFile(path)
    msg = expect_error(e, str(path), str(MAX_HEADER_BYTES), "limit")
    assert str(huge) not in msg  # the field is 8 bytes of whatever the file holds: never shown
    # a length field of 2^64-1 (garbage) is the same fault, not an overflow
    write_raw(path, b"{}", header_len=2**64 - 1)
    with pytest.raises(CheckpointError):
        SafetensorsFile(path)


def test_offsets_past_end_of_file(tmp_path):
    path = write_raw(tmp_path / "model.safetensors",
                     {"a": entry("F32", [2], 0, 8), "b": entry("F32", [4], 8, 24)}, bytes(16))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(path), "'b'", "past the end", "[8, 24]", "16")


def test_overlapping_offsets(tmp_path):
    path = write_raw(tmp_path / "model.safetensors",
                     {"a": entry("F32", [4], 0, 16), "b": entry("F32", [4], 8, 24)}, bytes(24))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(path), "'a'", "'b'", "overlap")


def test_duplicate_offsets_are_overlap(tmp_path):
    write_raw(tmp_path / "model.safetensors", {"a": entry("BF16", [2], 0, 4), "b": entry("F16", [2], 0, 4)},
              bytes(4))
    with pytest.raises(CheckpointError, match="overlap"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("shape,offsets,needle", [
    ([2, 2], [0, 12], "needs 16"),    # fewer bytes than the shape
    ([2, 2], [0, 20], "needs 16"),    # more bytes than the shape
    ([3], [8, 4], "[8, 4]"),          # end before begin
])
def test_size_does_not_match_shape(tmp_path, shape, offsets, needle):
    path = write_raw(tmp_path / "model.safetensors", {"t": entry("F32", shape, *offsets)}, bytes(32))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(path), "'t'", needle)


@pytest.mark.parametrize("bad", [
    {"dtype": "F32", "shape": [2]},                                   # no data_offsets
    {"dtype": "F32", "data_offsets": [0, 8]},                         # no shape
    {"dtype": "F32", "shape": [2], "data_offsets": [0]},              # one offset
    {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]},       # strings
    {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]},         # non-integer dimension
    {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]},             # shape not a list
    "F32",                                                            # not an object
])
def test_malformed_entry(tmp_path, bad):
    path = write_raw(tmp_path / "model.safetensors", {"t": bad}, bytes(8))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(path), "'t'", "corrupt header entry")


def test_unknown_dtype(tmp_path):
    path = write_raw(tmp_path / "model.safetensors", {"t": entry("F7", [2], 0, 2)}, bytes(2))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(path), "'t'", "F7")


def test_negative_dimension(tmp_path):
    path = write_raw(tmp_path / "model.safetensors", {"t": entry("F32", [-2, -2], 0, 16)}, bytes(16))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(path), "'t'", "negative")


def test_duplicate_tensor_name_in_header(tmp_path):
    head = b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, ' \
           b'"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}'
    path = write_raw(tmp_path / "model.safetensors", head, bytes(8))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(path), "duplicate", "'t'")


def test_same_tensor_in_two_unindexed_files(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"x": np.ones(2, np.float32)}, "F32")
    write_safetensors(tmp_path / "b.safetensors", {"x": np.ones(2, np.float32)}, "F32")
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, "'x'", "a.safetensors", "b.safetensors")


def test_unindexed_files_are_all_read(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"x": np.ones(2, np.float32)}, "F32")
    write_safetensors(tmp_path / "b.safetensors", {"y": np.zeros(3, np.float32)}, "F32")
    assert sorted(Checkpoint(tmp_path).names) == ["x", "y"]


def test_no_weights_in_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(tmp_path), "model.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, "pytorch_model.bin", "only safetensors")


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path / "nowhere")
    expect_error(e, str(tmp_path / "nowhere"), "not a directory")


def _sharded(tmp_path: Path) -> Path:
    tensors = {f"t{i}": np.full(3, i, np.float32) for i in range(4)}
    return write_model(tmp_path / "m", {}, tensors, "F32", shards=2)


def test_shard_listed_in_index_but_missing(tmp_path):
    d = _sharded(tmp_path)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        Checkpoint(d)
    expect_error(e, str(d / "model-00002-of-00002.safetensors"), "missing shard", "model.safetensors.index.json")


def test_index_lists_tensor_absent_from_shard(tmp_path):
    d = _sharded(tmp_path)
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(d)
    expect_error(e, "model-00001-of-00002.safetensors", "'ghost.weight'", "index")


@pytest.mark.parametrize("text", ["{broken", "[]", '{"metadata": {}}', '{"weight_map": ["a"]}',
                                  '{"weight_map": {"a": 3}}'])
def test_corrupt_index(tmp_path, text):
    d = _sharded(tmp_path)
    (d / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(d)
    expect_error(e, str(d / "model.safetensors.index.json"), "corrupt index", "weight_map")


def test_corrupt_shard_is_named(tmp_path):
    d = _sharded(tmp_path)
    shard = d / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(CheckpointError) as e:
        Checkpoint(d)
    expect_error(e, str(shard), "truncated")


def test_errors_are_cudflash_errors():
    assert issubclass(CheckpointError, CudflashError)


# ------------------------------------------------------------------- the format's exact layout (spec rules)

def test_space_padding_is_the_only_padding(tmp_path):
    header = json.dumps({"x": entry("F32", [1], 0, 4)}).encode()
    write_raw(tmp_path / "model.safetensors", header + b"     ", bytes(4))
    assert Checkpoint(tmp_path).float32("x") == 0
    for pad in (b"\n", b"\t", b"\x00", b" x"):
        path = write_raw(tmp_path / "model.safetensors", header + pad, bytes(4))
        with pytest.raises(CheckpointError) as e:
            Checkpoint(tmp_path)
        expect_error(e, str(path), "corrupt header", "padding")


def test_gap_between_tensors(tmp_path):
    path = write_raw(tmp_path / "model.safetensors", {"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 6, 10)},
                     bytes(10))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(path), "gap of 2 bytes", "'b'")


def test_bytes_after_the_last_tensor(tmp_path):
    path = write_raw(tmp_path / "model.safetensors", {"a": entry("F32", [1], 0, 4)}, bytes(7))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(path), "3 bytes after the last tensor", "cover 4")


def test_entry_with_an_extra_field(tmp_path):
    path = write_raw(tmp_path / "model.safetensors", {"a": {**entry("F32", [1], 0, 4), "scale": 1}}, bytes(4))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(path), "'a'", "corrupt header entry", "exactly")


@pytest.mark.parametrize("metadata", [{"format": 1}, ["pt"], "pt"])
def test_metadata_maps_strings_to_strings(tmp_path, metadata):
    path = write_raw(tmp_path / "model.safetensors", {"__metadata__": metadata, "a": entry("F32", [1], 0, 4)},
                     bytes(4))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(path), "__metadata__", "strings")


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}, 5, None])
def test_dtype_that_is_not_a_string(tmp_path, dtype):
    path = write_raw(tmp_path / "model.safetensors", {"a": {**entry("F32", [1], 0, 4), "dtype": dtype}}, bytes(4))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    expect_error(e, str(path), "'a'", "unknown dtype", "of type")


def test_names_are_quoted_on_one_line(tmp_path):
    name = "evil\nname" + "x" * 500
    path = write_raw(tmp_path / "model.safetensors", {name: entry("F7", [1], 0, 4)}, bytes(4))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path)
    msg = expect_error(e, str(path), "'evil\\nname")
    assert len(msg) < len(str(path)) + 300


def test_shrinking_file_is_refused_before_the_read(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"a": np.ones(8, np.float32), "b": np.ones(8, np.float32)},
                      "F32")
    sf = SafetensorsFile(tmp_path / "model.safetensors")
    np.testing.assert_array_equal(sf.array(sf.tensors["a"]), np.ones(8))
    size = sf.file_size
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(size - 4)
    with pytest.raises(CheckpointError) as e:
        sf.array(sf.tensors["a"])  # even a tensor whose bytes remain: the file is being changed under the map
    expect_error(e, "shrank", str(size), str(size - 4), "'a'")
