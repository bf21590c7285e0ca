"""Corrupt checkpoints, index files, configs and weights, made programmatically from one small valid pair: every
one is refused by `LLM(...)` with one cudflash error of one line that names the file, and nothing of a file
outside the model folder ever shows in a message. A few go through the CLI (exit 2, one line, no traceback).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.checkpoint import MAX_HEADER_BYTES, Checkpoint
from cudflash.model_files import shown
from cudflash.backends.numpy_backend import NumpyBackend
from cudflash.errors import CheckpointError, ConfigError, CudflashError
from cudflash.models.weights import WeightLoader
from cudflash.tiny import TinyShape, draft_config, draft_tensors, write_model, write_random_pair, write_safetensors
from tests.conftest import ROOT, expect_error

SHAPE = TinyShape(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                  intermediate_size=48, target_layer_ids=[0, 1], draft_layers=1, block_size=4,
                  max_position_embeddings=128, shards=2)
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
PASSWD = b"root:x:0:0:SECRET-LINE:/root:/bin/bash\n"
# What a refused outside file holds: its text, and its first 8 bytes read as a header length.
SECRETS = ("SECRET", "root:x", str(struct.unpack("<Q", PASSWD[:8])[0]))


@dataclass
class Pair:
    target: Path
    drafter: Path
    outside: Path  # beside the pair, outside both model folders: a secret text file, a valid safetensors file

    @property
    def draft_file(self) -> Path:
        return self.drafter / "model.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    write_random_pair(root / "pair", SHAPE, seed=5)
    outside = root / "outside"
    outside.mkdir()
    (outside / "passwd").write_bytes(PASSWD)
    write_safetensors(outside / "secret.safetensors", {"SECRET_TENSOR": np.ones(4, np.float32)}, "F32")
    shutil.copy(root / "pair" / "target" / SHARD2, outside / SHARD2)  # a valid shard of the target, outside it
    return root


@pytest.fixture
def pair(pristine, tmp_path) -> Pair:
    shutil.copytree(pristine, tmp_path / "p", symlinks=True)
    return Pair(tmp_path / "p" / "pair" / "target", tmp_path / "p" / "pair" / "drafter", tmp_path / "p" / "outside")


def load(p: Pair, **kw) -> LLM:
    return LLM(p.target, draft=p.drafter, backend="cpu", num_kv_blocks=16, **kw)


def refused(p: Pair, error: type[CudflashError], *needles: str, **kw) -> str:
    with pytest.raises(CudflashError) as e:
        load(p, **kw)
    assert isinstance(e.value, error), repr(e.value)
    msg = expect_error(e, *needles)
    for secret in SECRETS:
        assert secret not in msg, msg
    return msg


def test_the_pristine_pair_loads_and_generates(pair):
    """Every case below starts from this pair: the error each one gets comes from its corruption alone."""
    out = load(pair).generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


# ------------------------------------------------------------------------------------ safetensors headers

def split(path: Path) -> tuple[dict, bytes]:
    """Our own valid file's header and data area."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def write_file(path: Path, head: dict | bytes, data: bytes, length_delta: int = 0, pad: bytes = b"") -> None:
    raw = (head if isinstance(head, bytes) else json.dumps(head).encode()) + pad
    path.write_bytes(struct.pack("<Q", len(raw) + length_delta) + raw + data)


def first(h: dict) -> str:
    """The tensor at offset 0."""
    return min((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])


def edit_entry(field: str, value: object) -> Callable[[dict, bytes], tuple]:
    def edit(h: dict, data: bytes) -> tuple:
        if value is _DELETE:
            del h[first(h)][field]
        else:
            h[first(h)][field] = value
        return h, data
    return edit


_DELETE = object()


def shift_after_first(gap: int) -> Callable[[dict, bytes], tuple]:
    """Every tensor but the first moved by `gap` bytes (a hole, or with gap < 0 an overlap)."""
    def edit(h: dict, data: bytes) -> tuple:
        n0 = first(h)
        end0 = h[n0]["data_offsets"][1]
        for k, e in h.items():
            if k not in ("__metadata__", n0):
                e["data_offsets"] = [o + gap for o in e["data_offsets"]]
        body = data[:end0] + bytes(gap) + data[end0:] if gap > 0 else data[:gap]
        return h, body
    return edit


def deep(levels: int) -> bytes:
    return b'{"t": ' + b"[" * levels + b"]" * levels + b"}"


HEADER_EDITS: dict[str, Callable[[dict, bytes], tuple]] = {
    # the length field against what the JSON occupies (the file is written with 3 spaces of padding)
    **{f"length{d:+d}": (lambda d: lambda h, data: (h, data, d))(d) for d in (-1, -2, -3, -4, -8, 1, 2, 8)},
    "length-zero": lambda h, data: (b"", data),
    # padding other than spaces, bytes before the object
    **{f"pad-{name}": (lambda c: lambda h, data: (json.dumps(h).encode() + c, data))(c)
       for name, c in (("newline", b"\n"), ("tab", b"\t"), ("nul", b"\x00"), ("letter", b"x"), ("brace", b"}"))},
    "leading-space": lambda h, data: (b" " + json.dumps(h).encode(), data),
    "bom": lambda h, data: (b"\xef\xbb\xbf" + json.dumps(h).encode(), data),
    # not one JSON object
    **{f"not-object-{i}": (lambda b: lambda h, data: (b, data))(b)
       for i, b in enumerate([b"[1, 2]", b"1", b'"x"', b"null", b"{not json}", b'{"a": }', b"{}{}", b"\xff\xfe{}"])},
    "deep-100k": lambda h, data: (deep(100_000), data),
    "deep-entry": lambda h, data: (b'{"t": {"dtype": {"a": {"b": {"c": [[[1]]]}}}}}', data),
    "duplicate-name": lambda h, data: (b'{"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
                                       b'"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', data),
    "nan-offset": lambda h, data: (b'{"t": {"dtype": "U8", "shape": [1], "data_offsets": [NaN, 1]}}', data),
    "huge-int": lambda h, data: (b'{"t": {"dtype": "U8", "shape": [' + b"9" * 80 + b'], "data_offsets": [0, 1]}}',
                                 data),
    "non-utf8-name": lambda h, data: (b'{"\xff\xfe": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', data),
    # every field of an entry, wrongly typed or out of range
    **{f"dtype-{i}": edit_entry("dtype", v) for i, v in enumerate(["F7", "bf16", "", 5, None, ["BF16"], {"a": 1}])},
    **{f"shape-{i}": edit_entry("shape", v)
       for i, v in enumerate(["3", 3, [1.5], [True], [-1], [None], [[1]], [1] * 40, [2**62, 0], _DELETE])},
    **{f"offsets-{i}": edit_entry("data_offsets", v)
       for i, v in enumerate([[0], [0, 1, 2], ["0", "8"], [0.0, 8.0], [-2, 6], [8, 0], None, [True, False],
                              _DELETE])},
    "entry-extra-field": edit_entry("extra", 1),
    **{f"entry-{i}": (lambda v: lambda h, data: ({**h, first(h): v}, data))(v)
       for i, v in enumerate(["x", [], None, 5])},
    **{f"metadata-{i}": (lambda v: lambda h, data: ({**h, "__metadata__": v}, data))(v)
       for i, v in enumerate([{"a": 1}, [1], "x", {"a": ["b"]}, None, {"a": {"b": "c"}}])},
    # the data area against the offsets
    "trailing-byte": lambda h, data: (h, data + b"\0"),
    "trailing-8-bytes": lambda h, data: (h, data + bytes(8)),
    "gap": shift_after_first(2),
    "overlap": shift_after_first(-2),
    "past-end": lambda h, data: (h, data[:-1]),
    "size-mismatch": lambda h, data: (({**h, first(h): {**h[first(h)], "shape": [1]}}), data),
    "empty-tensor-inside-another": lambda h, data: ({**h, "e": {"dtype": "F32", "shape": [0], "data_offsets": [2, 2]}},
                                                    data),
    "same-offsets-twice": lambda h, data: ({**h, "dup": dict(h[first(h)])}, data),
}


@pytest.mark.parametrize("edit", list(HEADER_EDITS), ids=list(HEADER_EDITS))
def test_corrupt_drafter_header(pair, edit):
    h, data = split(pair.draft_file)
    head, body, *delta = HEADER_EDITS[edit](h, data)
    write_file(pair.draft_file, head, body, delta[0] if delta else 0, pad=b"   " if delta else b"")
    refused(pair, CheckpointError, str(pair.draft_file))


@pytest.mark.parametrize("edit", ["length-1", "pad-newline", "deep-100k", "dtype-3", "shape-4", "offsets-5",
                                  "metadata-0", "gap", "trailing-byte", "past-end"])
def test_corrupt_target_shard_header(pair, edit):
    shard = pair.target / SHARD2
    h, data = split(shard)
    head, body, *delta = HEADER_EDITS[edit](h, data)
    write_file(shard, head, body, delta[0] if delta else 0, pad=b"   " if delta else b"")
    refused(pair, CheckpointError, str(shard))


def test_length_one_short_would_shift_every_tensor(pair):
    """The case that used to load: padding absorbs a length field one byte short, so the JSON still parses and
    every tensor starts one byte early. The byte left over after the last tensor gives it away."""
    h, data = split(pair.draft_file)
    write_file(pair.draft_file, h, data, -1, pad=b"    ")
    refused(pair, CheckpointError, str(pair.draft_file), "1 bytes after the last tensor", "header length")


@pytest.mark.parametrize("keep", [0, 4, 7, 8, 12, "header-1", "header+3", -1, "half"])
def test_truncated_file(pair, keep):
    blob = pair.draft_file.read_bytes()
    n = 8 + struct.unpack("<Q", blob[:8])[0]
    cut = {"header-1": n - 1, "header+3": n + 3, "half": len(blob) // 2}.get(keep, keep)
    pair.draft_file.write_bytes(blob[:cut])
    refused(pair, CheckpointError, str(pair.draft_file))


@pytest.mark.parametrize("length", [2**64 - 1, MAX_HEADER_BYTES + 1, "file-size"])
def test_length_field_garbage(pair, length):
    blob = pair.draft_file.read_bytes()
    value = len(blob) if length == "file-size" else length
    pair.draft_file.write_bytes(struct.pack("<Q", value) + blob[8:])
    msg = refused(pair, CheckpointError, str(pair.draft_file))
    if length != "file-size":
        assert str(value) not in msg  # 8 bytes of the file, not a length: never echoed


def test_text_file_in_place_of_a_checkpoint(pair):
    pair.draft_file.write_bytes(PASSWD)
    refused(pair, CheckpointError, str(pair.draft_file), "not a safetensors file")


def test_fifo_in_place_of_a_checkpoint(pair):
    """A FIFO would block a plain open() forever."""
    pair.draft_file.unlink()
    os.mkfifo(pair.draft_file)
    refused(pair, CheckpointError, str(pair.draft_file), "not a regular file")


# ------------------------------------------------------------------------------- index files and traversal

def edit_index(p: Pair, edit: Callable[[dict], object]) -> None:
    doc = json.loads((p.target / INDEX).read_text())
    out = edit(doc)
    (p.target / INDEX).write_text(out if isinstance(out, str) else json.dumps(doc if out is None else out))


def retarget(shard_name: str) -> Callable[[dict], None]:
    """Every tensor of shard 2 listed under another name."""
    def edit(doc: dict) -> None:
        doc["weight_map"] = {k: (shard_name if v == SHARD2 else v) for k, v in doc["weight_map"].items()}
    return edit


def one_tensor(value: object) -> Callable[[dict], None]:
    def edit(doc: dict) -> None:
        doc["weight_map"][next(iter(doc["weight_map"]))] = value
    return edit


INDEX_EDITS: dict[str, tuple[Callable[[dict], object], tuple[str, ...]]] = {
    "not-json": (lambda d: "{broken", ("corrupt index",)),
    "array": (lambda d: [d], ("weight_map",)),
    "string": (lambda d: '"weight_map"', ("weight_map",)),
    "no-weight-map": (lambda d: {"metadata": {}}, ("weight_map",)),
    "weight-map-list": (lambda d: {"weight_map": list(d["weight_map"])}, ("weight_map",)),
    "weight-map-empty": (lambda d: {"weight_map": {}}, ("no tensors",)),
    "file-not-string": (one_tensor(3), ("weight_map",)),
    "file-list": (one_tensor([SHARD1]), ("weight_map",)),
    "metadata-list": (lambda d: {**d, "metadata": [1]}, ("metadata",)),
    "deep": (lambda d: '{"weight_map": ' + "[" * 50_000 + "]" * 50_000 + "}", ("nested deeper",)),
    "duplicate-key": (lambda d: '{"weight_map": {"a": "x"}, "weight_map": {"a": "y"}}', ("duplicate",)),
    "missing-shard": (retarget("model-00009-of-00009.safetensors"), ("missing shard",)),
    "ghost-tensor": (lambda d: d["weight_map"].update({"ghost.weight": SHARD1}), ("'ghost.weight'",)),
    "tensor-unlisted": (lambda d: d["weight_map"].pop("model.norm.weight") and None, ("'model.norm.weight'", "does not list")),
    "tensor-in-wrong-shard": (lambda d: d["weight_map"].update(
        {k: (SHARD1 if v == SHARD2 else SHARD2) for k, v in list(d["weight_map"].items())[:1]}),
        ("missing tensor",)),
    "shard-is-a-directory": (retarget("."), ("missing shard",)),
    "shard-is-the-index": (retarget(INDEX), ("corrupt",)),
    "empty-name": (retarget(""), ("not a file name",)),
    "nul-in-name": (retarget("model\x00.safetensors"), ("not a file name",)),
    # out of the folder: never opened, so nothing of it can show
    "dotdot-valid-shard-outside": (retarget(f"../../outside/{SHARD2}"), ("'..'", "refusing to read outside")),
    "dotdot-passwd": (retarget("../../outside/passwd"), ("'..'",)),
    "dotdot-deep": (retarget("../" * 30 + "etc/passwd"), ("'..'",)),
    "dotdot-inside-then-back": (retarget(f"sub/../{SHARD2}"), ("'..'",)),
    "backslash-dotdot": (retarget(f"..\\..\\outside\\{SHARD2}"), ("'..'",)),
    "absolute-passwd": (retarget("/etc/passwd"), ("absolute path",)),
    "absolute-dev-zero": (retarget("/dev/zero"), ("absolute path",)),
    "windows-drive": (retarget("C:\\Windows\\win.ini"), ("absolute path",)),
}


@pytest.mark.parametrize("case", list(INDEX_EDITS), ids=list(INDEX_EDITS))
def test_corrupt_index(pair, case):
    edit, needles = INDEX_EDITS[case]
    edit_index(pair, edit)
    refused(pair, CheckpointError, *needles)


def test_tensor_in_a_shard_the_index_does_not_name_for_it(pair):
    """Shard 1 also holds a tensor the index places in shard 2: which copy is meant is unknown."""
    h, data = split(pair.target / SHARD1)
    doc = json.loads((pair.target / INDEX).read_text())
    other = next(k for k, v in doc["weight_map"].items() if v == SHARD2)
    n0 = first(h)
    h[other] = {**h[n0], "data_offsets": [len(data), len(data) + len(data[slice(*h[n0]["data_offsets"])])],
                "shape": h[n0]["shape"]}
    write_file(pair.target / SHARD1, h, data + data[slice(*h[n0]["data_offsets"])])
    refused(pair, CheckpointError, str(pair.target / SHARD1), shown(other), "lists it in", "disagree")


def test_absolute_path_to_a_valid_shard_outside(pair):
    edit_index(pair, retarget(str(pair.outside / SHARD2)))
    refused(pair, CheckpointError, str(pair.target / INDEX), "absolute path")


@pytest.mark.parametrize("link_to", ["passwd", "secret.safetensors", SHARD2])
def test_symlinked_shard_that_leaves_the_folder(pair, link_to):
    (pair.target / SHARD2).unlink()
    (pair.target / SHARD2).symlink_to(pair.outside / link_to)
    refused(pair, CheckpointError, str(pair.target / INDEX), "symbolic link", "refusing to read outside")


def test_loop_of_links_as_a_shard(pair):
    (pair.target / SHARD2).unlink()
    (pair.target / SHARD2).symlink_to(pair.target / "loop")
    (pair.target / "loop").symlink_to(pair.target / SHARD2)
    refused(pair, CheckpointError, str(pair.target / INDEX), "loop of symbolic links")


def test_symlinked_subfolder_that_leaves_the_folder(pair):
    (pair.target / "sub").symlink_to(pair.outside, target_is_directory=True)
    edit_index(pair, retarget(f"sub/{SHARD2}"))
    refused(pair, CheckpointError, "symbolic link")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", INDEX])
def test_symlinked_file_of_the_drafter_that_leaves_the_folder(pair, name):
    target = {"model.safetensors": "secret.safetensors", "config.json": "passwd", INDEX: "passwd"}[name]
    (pair.drafter / name).unlink(missing_ok=True)
    (pair.drafter / name).symlink_to(pair.outside / target)
    refused(pair, CheckpointError if name != "config.json" else ConfigError, "symbolic link")


def test_links_that_stay_inside_are_followed(pair):
    """A link within the folder (or a whole folder reached through a link) is fine."""
    (pair.target / "real").mkdir()
    (pair.target / SHARD2).rename(pair.target / "real" / SHARD2)
    (pair.target / SHARD2).symlink_to(Path("real") / SHARD2)
    linked = pair.target.parent / "linked-target"
    linked.symlink_to(pair.target, target_is_directory=True)
    llm = LLM(linked, draft=pair.drafter, backend="cpu", num_kv_blocks=16)
    assert llm.generate([[3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids


def test_hub_cache_snapshot_links_into_its_blobs(tmp_path, pristine):
    """models--org--name/snapshots/<rev>/ links every file into ../../blobs/: that is the hub cache layout."""
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in (pristine / "pair" / "target").iterdir():
        shutil.copy(f, blobs / f"sha-{f.name}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"sha-{f.name}")
    assert sorted(Checkpoint(snap).names) == sorted(Checkpoint(pristine / "pair" / "target").names)
    (snap / SHARD2).unlink()
    (snap / SHARD2).symlink_to(tmp_path / "elsewhere.safetensors")
    shutil.copy(pristine / "pair" / "target" / SHARD2, tmp_path / "elsewhere.safetensors")
    with pytest.raises(CheckpointError, match="symbolic link"):
        Checkpoint(snap)


def test_index_over_its_size_limit(pair):
    index = pair.target / INDEX
    with open(index, "r+b") as f:  # valid JSON, then 64 MiB of zeros (sparse: nothing written)
        f.truncate(64 * 2**20 + 1)
    refused(pair, CheckpointError, str(index), "MiB limit")


# ------------------------------------------------------------------------------------------- configs

def edit_config(folder: Path, edit: Callable[[dict], object]) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    out = edit(cfg)
    (folder / "config.json").write_text(out if isinstance(out, str) else json.dumps(cfg if out is None else out))


def setter(key: str, value: object, nested: bool = False) -> Callable[[dict], None]:
    def edit(cfg: dict) -> None:
        (cfg["dflash_config"] if nested else cfg)[key] = value
    return edit


BAD_INTS = {"string": "16", "fraction": 16.5, "bool": True, "negative": -1, "zero": 0, "huge": 10**30,
            "list": [16], "object": {"v": 16}}
TARGET_INT_FIELDS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"]
DRAFT_INT_FIELDS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                    "num_target_layers", "block_size"]

CONFIG_EDITS: dict[str, tuple[str, Callable[[dict], object], tuple[str, ...]]] = {
    **{f"target-{f}-{kind}": ("target", setter(f, v), (f"'{f}'",))
       for f in TARGET_INT_FIELDS for kind, v in BAD_INTS.items()},
    **{f"drafter-{f}-{kind}": ("drafter", setter(f, v), (f"'{f}'",))
       for f in DRAFT_INT_FIELDS for kind, v in BAD_INTS.items()},
    **{f"drafter-mask-{kind}": ("drafter", setter("mask_token_id", v, nested=True), ("mask_token_id",))
       for kind, v in BAD_INTS.items() if kind != "zero"},
    "drafter-mask-outside-vocab": ("drafter", setter("mask_token_id", 64, nested=True), ("mask_token_id", "64")),
    **{f"target-eps-{kind}": ("target", setter("rms_norm_eps", v), ("rms_norm_eps",))
       for kind, v in {"string": "1e-6", "nan": float("nan"), "inf": float("inf"), "zero": 0, "negative": -1e-6,
                       "bool": True, "huge": 1e300}.items()},
    **{f"target-theta-{kind}": ("target", lambda c, v=v: c["rope_parameters"].update(rope_theta=v), ("rope_theta",))
       for kind, v in {"string": "1e6", "inf": float("inf"), "one": 1, "list": [1e6]}.items()},
    **{f"target-architectures-{i}": ("target", setter("architectures", v), ("architecture",))
       for i, v in enumerate([5, [5], {"a": 1}, [["Qwen3ForCausalLM"]], ["MistralForCausalLM"], []])},
    **{f"drafter-architectures-{i}": ("drafter", setter("architectures", v), ("architectures",))
       for i, v in enumerate([5, [None], {"DFlashDraftModel": 1}])},
    **{f"drafter-projector-{i}": ("drafter", setter("projector_type", v, nested=True), ("projector_type",))
       for i, v in enumerate([["dflash2"], 5, {"a": 1}, "domino"])},
    **{f"target-bool-{f}-{i}": ("target", setter(f, v), (f,))
       for f in ("tie_word_embeddings", "attention_bias") for i, v in enumerate(["false", 0, [True]])},
    "target-hidden-act-list": ("target", setter("hidden_act", ["silu"]), ("hidden_act",)),
    "target-hidden-act-gelu": ("target", setter("hidden_act", "gelu"), ("hidden_act",)),
    "target-rope-type-list": ("target", lambda c: c["rope_parameters"].update(rope_type=["yarn"]), ("RoPE type",)),
    "target-rope-parameters-string": ("target", setter("rope_parameters", "default"), ("rope_parameters",)),
    **{f"target-eos-{i}": ("target", setter("eos_token_id", v), ("eos_token_id",))
       for i, v in enumerate(["0", [0, "1"], -1, 1.5, {"id": 0}])},
    # consistency
    "target-kv-heads-not-dividing": ("target", setter("num_key_value_heads", 3), ("num_key_value_heads 3",)),
    "target-head-dim-odd": ("target", setter("head_dim", 15), ("head_dim 15",)),
    "target-hidden-not-multiple": ("target", lambda c: (c.pop("head_dim"), c.update(hidden_size=33)) and None,
                                   ("hidden_size 33",)),
    "drafter-target-layer-beyond-target": ("drafter", setter("target_layer_ids", [0, 2], nested=True),
                                           ("target_layer_ids", "2")),
    **{f"drafter-target-layers-{i}": ("drafter", setter("target_layer_ids", v, nested=True), ("target_layer_ids",))
       for i, v in enumerate([[], "0,1", [1.5], [-1], [True], [0] * 2000, {"0": 1}])},
    "drafter-hidden-differs": ("drafter", lambda c: c.update(hidden_size=64, head_dim=32), ("hidden_size",)),
    "drafter-block-size-absurd": ("drafter", setter("block_size", 100_000), ("block_size",)),
    **{f"drafter-layer-types-{i}": ("drafter", setter("layer_types", v), ("layer_types",))
       for i, v in enumerate(["full_attention", [1], ["full_attention"] * 3])},
    **{f"drafter-dflash-config-{i}": ("drafter", setter("dflash_config", v), ("dflash_config",))
       for i, v in enumerate([[1], "x", 5])},
    # the document itself
    **{f"{who}-not-object-{i}": (who, (lambda t: lambda c: t)(t), ("JSON object",))
       for who in ("target", "drafter") for i, t in enumerate(["[1]", "5", '"x"', "null"])},
    **{f"{who}-deep": (who, lambda c: '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", ("nested deeper",))
       for who in ("target", "drafter")},
    "target-deep-object": ("target", lambda c: "".join('{"a":' for _ in range(70)) + "1" + "}" * 70,
                           ("nested deeper",)),
    "target-huge-integer-literal": ("target", lambda c: json.dumps(c)[:-1] + ', "x": ' + "9" * 5000 + "}",
                                    ("digits",)),
    "target-duplicate-key": ("target", lambda c: json.dumps(c)[:-1] + ', "hidden_size": 64}', ("duplicate",)),
    "target-not-utf8": ("target", lambda c: "\udcff", ("UTF-8",)),
    "target-truncated": ("target", lambda c: json.dumps(c)[:40], ("not valid JSON",)),
}


@pytest.mark.parametrize("case", list(CONFIG_EDITS), ids=list(CONFIG_EDITS))
def test_bad_config(pair, case):
    who, edit, needles = CONFIG_EDITS[case]
    folder = getattr(pair, who)
    if case == "target-not-utf8":
        (folder / "config.json").write_bytes(b'{"a": "\xff"}')
    else:
        edit_config(folder, edit)
    refused(pair, ConfigError, "config.json", *needles)


def test_config_over_its_size_limit(pair):
    with open(pair.target / "config.json", "r+b") as f:
        f.truncate(17 * 2**20)
    refused(pair, ConfigError, str(pair.target / "config.json"), "MiB limit")


def test_absurd_sizes_give_a_clear_error_not_memory_error(pair):
    """The RoPE tables used to be sized from max_position_embeddings and the layer lists from
    num_hidden_layers: values past the bounds are refused, large ones inside them load with small tables."""
    edit_config(pair.target, setter("max_position_embeddings", 10**12))
    refused(pair, ConfigError, "max_position_embeddings", "<=")
    edit_config(pair.target, setter("max_position_embeddings", 1 << 27))  # 128 Mi positions: a 32 GiB table
    llm = load(pair)
    assert llm.runner.target.rope_cos.shape == (16 * 16 + SHAPE.block_size + 1, SHAPE.head_dim // 2)
    edit_config(pair.target, setter("num_hidden_layers", 10**9))
    refused(pair, ConfigError, "num_hidden_layers")


# ------------------------------------------------------------------------------------------- weights

def set_values(path: Path, name: str, bits: int | None) -> None:
    """Element 0 of a BF16 tensor set to the given bit pattern, or (bits None) the whole tensor zeroed."""
    h, data = split(path)
    begin, end = h[name]["data_offsets"]
    a = np.frombuffer(data, np.uint16).copy()
    if bits is None:
        a[begin // 2:end // 2] = 0
    else:
        a[begin // 2] = bits
    write_file(path, h, a.tobytes())


def shard_of(p: Pair, name: str) -> Path:
    return p.target / json.loads((p.target / INDEX).read_text())["weight_map"][name]


NAN, POS_INF, NEG_INF, NEG_NAN = 0x7FC0, 0x7F80, 0xFF80, 0xFFC1
WEIGHT_EDITS = {
    "target-nan-down-proj": ("model.layers.0.mlp.down_proj.weight", NAN, "NaN or Inf"),
    "target-inf-norm": ("model.norm.weight", POS_INF, "NaN or Inf"),
    "target-neg-inf-embedding": ("model.embed_tokens.weight", NEG_INF, "NaN or Inf"),
    "target-negative-nan-lm-head": ("lm_head.weight", NEG_NAN, "NaN or Inf"),
    "target-nan-q-norm": ("model.layers.1.self_attn.q_norm.weight", NAN, "NaN or Inf"),
    "target-zero-embedding": ("model.embed_tokens.weight", None, "all zeros"),
    "target-zero-lm-head": ("lm_head.weight", None, "all zeros"),
    "target-zero-q-proj": ("model.layers.1.self_attn.q_proj.weight", None, "all zeros"),
    "target-zero-up-proj": ("model.layers.0.mlp.up_proj.weight", None, "all zeros"),
    "drafter-neg-inf-fc": ("fc.weight", NEG_INF, "NaN or Inf"),
    "drafter-nan-k-norm": ("layers.0.self_attn.k_norm.weight", NAN, "NaN or Inf"),
    "drafter-zero-fc": ("fc.weight", None, "all zeros"),
    "drafter-zero-o-proj": ("layers.0.self_attn.o_proj.weight", None, "all zeros"),
}


@pytest.mark.parametrize("case", list(WEIGHT_EDITS), ids=list(WEIGHT_EDITS))
def test_bad_weights_are_refused_with_the_tensor_name(pair, case):
    name, bits, needle = WEIGHT_EDITS[case]
    path = pair.draft_file if case.startswith("drafter") else shard_of(pair, name)
    set_values(path, name, bits)
    refused(pair, CheckpointError, str(path), f"'{name}'", needle)


@pytest.mark.parametrize("dtype", ["F16", "F32"])
def test_non_finite_weights_in_other_float_dtypes(pair, dtype):
    tensors = draft_tensors(SHAPE, np.random.default_rng(1))
    tensors["layers.0.mlp.gate_proj.weight"][3, 5] = np.inf if dtype == "F16" else np.nan
    write_model(pair.drafter, draft_config(SHAPE), tensors, dtype)
    refused(pair, CheckpointError, "'layers.0.mlp.gate_proj.weight'", "NaN or Inf")


def test_check_weights_false_trusts_the_checkpoint(pair):
    set_values(shard_of(pair, "model.norm.weight"), "model.norm.weight", NAN)
    llm = load(pair, check_weights=False)
    assert np.isnan(llm.runner.target.norm).any()
    with pytest.raises(ConfigError, match="check_weights"):
        load(pair, check_weights="no")


def test_zero_biases_and_neutral_heads_are_legitimate(tmp_path):
    """All-zero tensors a real model can hold (biases, a freshly initialised DFlash2 conv projection, a neutral
    selector) load."""
    from cudflash.tiny import TinyHeads
    shape = TinyShape(arch="qwen2", vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=16, intermediate_size=48, target_layer_ids=[0, 1], draft_layers=1, block_size=4,
                      max_position_embeddings=64,
                      heads=TinyHeads(kind="dflash2", conv_identity=True, selector_scale=0.0, conv_group_size=16))
    target, drafter = write_random_pair(tmp_path, shape)
    h, data = split(target / "model.safetensors")
    begin, end = h["model.layers.0.self_attn.k_proj.bias"]["data_offsets"]
    write_file(target / "model.safetensors", h, data[:begin] + bytes(end - begin) + data[end:])
    LLM(target, draft=drafter, backend="cpu", num_kv_blocks=16)


# ---------------------------------------------------------------------------------- files that shrink

def test_file_truncated_after_it_was_mapped(pair):
    """Read a tensor, truncate the file under the map, read the next: a CheckpointError, not a SIGBUS."""
    ckpt = Checkpoint(pair.drafter)
    ckpt.raw("fc.weight")
    with open(pair.draft_file, "r+b") as f:
        f.truncate(pair.draft_file.stat().st_size // 2)
    with pytest.raises(CheckpointError) as e:
        for name in ckpt.names:
            np.array(ckpt.array(name))  # would fault on the missing pages without the size check
    expect_error(e, str(pair.draft_file), "shrank", "while open")


def test_shard_truncated_during_the_load(pair):
    """The load itself: after the first tensor arrives, shard 2 loses its tail; the next read from it refuses."""
    ckpt = Checkpoint(pair.target)
    shard = pair.target / SHARD2

    def shrink(nbytes: int) -> None:
        if shard.stat().st_size > 100:
            with open(shard, "r+b") as f:
                f.truncate(100)

    loader = WeightLoader(ckpt, NumpyBackend(), progress=shrink)
    with pytest.raises(CheckpointError) as e:
        for name in ckpt.names:
            loader.get(name, ckpt.info(name).shape)
    expect_error(e, str(shard), "shrank")


# -------------------------------------------------------------------------------------------- the CLI

CLI_CASES = {
    "traversal": lambda p: edit_index(p, retarget(f"../../outside/{SHARD2}")),
    # the first tensor loaded: the CLI's progress line (printed after 0.5 s of loading) never starts
    "nan-weight": lambda p: set_values(shard_of(p, "model.embed_tokens.weight"), "model.embed_tokens.weight", NAN),
    "deep-config": lambda p: edit_config(p.target, lambda c: '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    "header-length-short": lambda p: (lambda h, d: write_file(p.target / SHARD1, h, d, -1, b"  "))(
        *split(p.target / SHARD1)),
}


@pytest.mark.parametrize("case", list(CLI_CASES), ids=list(CLI_CASES))
def test_cli_exits_2_with_one_line(pair, case, tmp_path):
    CLI_CASES[case](pair)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [3, 4, 5]}) + "\n")
    r = subprocess.run([sys.executable, "-m", "cudflash", "generate", "--target", str(pair.target), "--draft",
                        str(pair.drafter), "--prompts", str(prompts), "--backend", "cpu", "--max-new-tokens", "2"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cudflash: error: "), r.stderr
    assert "Traceback" not in r.stderr and not any(s in r.stderr for s in SECRETS)
    assert r.stdout == ""
