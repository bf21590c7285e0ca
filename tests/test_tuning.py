"""The CUDA backend's tuning as configuration: parsed by field type, refused with a message naming the field, handed
to the backend (never a module global), and the tracing tools kept out of the package."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from cudflash import LLM
from cudflash.backends import get_backend, kernel_source
from cudflash.backends.tuning import INVARIANT_CONTEXT_LIMIT, CudaTuning, as_tuning, parse_tuning
from cudflash.cli import main
from cudflash.errors import BackendError, ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_values_are_read_as_their_fields_type_and_the_last_assignment_wins(tmp_path):
    t = parse_tuning(["pdl=off", "run_ahead=No", "stream_gemm_prefill_stages=0x3", "stream_gemm_min_bytes=1048576",
                      "invariant_max_context=0", f"kernel_dir={tmp_path}", "nvrtc_options=-DCF_TRACE  -lineinfo",
                      "stream_gemm_prefill_stages=1"])
    want = dict(pdl=False, run_ahead=False, stream_gemm_prefill_stages=1, stream_gemm_min_bytes=1 << 20,
                invariant_max_context=0, kernel_dir=str(tmp_path), nvrtc_options=("-DCF_TRACE", "-lineinfo"))
    assert t == CudaTuning(**want) and t.changed() == want
    assert parse_tuning(["pdl=1", "kernel_dir=none"]) == CudaTuning() and parse_tuning([]) == CudaTuning()


@pytest.mark.parametrize("text,message", [
    ("prefill_stages=1", r"unknown tuning field 'prefill_stages' \(expected one of pdl, run_ahead, stream_gemm_"),
    ("PREFILL_STAGES=1", "unknown tuning field 'PREFILL_STAGES'"),
    ("pdl=maybe", "pdl expects true or false"),
    ("stream_gemm_prefill_stages=two", "stream_gemm_prefill_stages expects an integer"),
    ("stream_gemm_prefill_stages=-1", "tuning.stream_gemm_prefill_stages: expected a non-negative integer, got -1"),
    ("quantized_stream_max_rows=-16", "tuning.quantized_stream_max_rows: expected a non-negative integer, got -16"),
    ("quantized_launch_rows=48", "tuning.quantized_launch_rows: 16, 32 or 64, got 48"),
    ("stream_gemm_w8_warps=16", "tuning.stream_gemm_w8_warps: 4 or 8, got 16"),
    ("stream_gemm_quantized_stages=17", "tuning.stream_gemm_quantized_stages: 0 to 16 .MAX_STAGES., got 17"),
    ("stream_gemm_prefetch_all_kib=-1", "tuning.stream_gemm_prefetch_all_kib: expected a non-negative integer"),
    ("stream_gemm_prefetch_all_kib=228", "tuning.stream_gemm_prefetch_all_kib: at most 227"),
    ("shared_memory_carveout=101", r"tuning.shared_memory_carveout: a percentage 0..100, or -1 \(the driver's"),
    ("shared_memory_carveout=-2", "tuning.shared_memory_carveout: a percentage 0..100, or -1"),
    (f"invariant_max_context={2 * INVARIANT_CONTEXT_LIMIT}", f"at most {INVARIANT_CONTEXT_LIMIT} keys"),
    ("kernel_dir=/no/such/folder", "tuning.kernel_dir: /no/such/folder is not a folder"),
    ("pdl", "expected NAME=VALUE"),
])
def test_a_bad_assignment_names_the_field_and_what_was_expected(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_tuning([text])


def test_the_carveout_goes_to_the_named_kernels_or_to_every_kernel():
    t = parse_tuning(["shared_memory_carveout=100", "shared_memory_carveout_kernels=attn_combine gdn_mixer"])
    assert t.carveout("attn_combine<128, false>") == 100 and t.carveout("gdn_mixer<128, 128>") == 100
    assert t.carveout("attn_fwd<128, 4, 1, false>") == -1 and t.carveout("rope_store") == -1
    assert CudaTuning(shared_memory_carveout=50).carveout("rope_store") == 50
    assert CudaTuning().carveout("attn_combine<128, false>") == -1


def test_a_dict_takes_the_fields_and_nothing_else():
    assert as_tuning({"pdl": False, "nvrtc_options": ["-lineinfo"]}) == CudaTuning(pdl=False,
                                                                                   nvrtc_options=("-lineinfo",))
    assert as_tuning(None) == CudaTuning()
    with pytest.raises(ConfigError, match="unknown field 'RUN_AHEAD'"):
        as_tuning({"RUN_AHEAD": False})
    with pytest.raises(ConfigError, match="tuning.stream_gemm_prefill_stages: expected an integer, got True"):
        as_tuning({"stream_gemm_prefill_stages": True})
    with pytest.raises(ConfigError, match="tuning: expected a CudaTuning or a dict, got str"):
        as_tuning("pdl=0")


def test_a_tuning_is_a_frozen_value_usable_as_a_cache_key():
    a, b = CudaTuning(stream_gemm_prefill_stages=1), CudaTuning(stream_gemm_prefill_stages=1)
    assert a == b and hash(a) == hash(b) and a != CudaTuning()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.stream_gemm_prefill_stages = 3  # type: ignore[misc]


def test_the_cpu_backend_refuses_a_tuning_it_would_ignore(tiny_pair):
    assert get_backend("cpu", {"pdl": True}).name == "cpu"  # the defaults: nothing is ignored
    with pytest.raises(BackendError, match="sets pdl, stream_gemm_prefill_stages, which only the cuda backend has"):
        get_backend("cpu", CudaTuning(pdl=False, stream_gemm_prefill_stages=0))
    with pytest.raises(BackendError, match="the tuning sets run_ahead, which only the cuda backend has"):
        LLM(tiny_pair / "target", backend="cpu", tuning={"run_ahead": False})


@pytest.mark.parametrize("tune,message", [
    ("bogus=1", "cudflash: error: --tune bogus=1: unknown tuning field 'bogus'"),
    ("invariant_max_context=big", "cudflash: error: --tune invariant_max_context=big: invariant_max_context expects "
                                  "an integer"),
    ("pdl=0", "cudflash: error: the tuning sets pdl, stream_gemm_prefill_stages, which only the cuda backend has "
              "(backend is cpu)"),
])
def test_bench_tune_errors_are_one_line_and_exit_2(capsys, tune, message):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--synthetic", "tiny", "--backend", "cpu", "--new", "1",
              "--tune", "stream_gemm_prefill_stages=1", "--tune", tune])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().splitlines()[-1].startswith(message) and "Traceback" not in err


def test_kernel_sources_are_read_from_the_tuning_folder(tmp_path):
    """A tuning's kernel_dir is where the sources come from, cached per folder: the same module name gives that
    folder's text, and the package's folder keeps its own."""
    folder = tmp_path / "variant"
    common = kernel_source.kernel_root().joinpath("common.cuh").read_text(encoding="utf-8")
    kernel_source.copy_sources(folder, {"common.cuh": common + "\n#define CF_VARIANT 1\n"})
    variant, default = kernel_source.source("norm", str(folder)), kernel_source.source("norm")
    assert "#define CF_VARIANT 1" in variant and "CF_VARIANT" not in default
    assert f'#line 1 "{folder.resolve() / "norm.cu"}"' in variant


def test_the_package_reads_no_tuning_from_the_environment_and_imports_no_tracing_tool():
    """Tracing costs nothing when off: no module of the package reads an environment variable to configure the
    kernels or imports the step timeline's tool (scripts/step_trace.py); module-level switches are gone."""
    for path in (ROOT / "cudflash" / "backends").glob("*.py"):
        text = path.read_text()
        assert "os.environ" not in text and "getenv" not in text, path.name
        assert not re.search(r"^\s*(from|import) .*\btrace\b", text, flags=re.M), path.name
    assert not (ROOT / "cudflash" / "backends" / "trace.py").exists()
    for path in (ROOT / "cudflash").rglob("*.py"):
        assert "CUDFLASH_TRACE" not in path.read_text(), path
    gone = {"stream_gemm.py": ("ENABLED", "PROGRAMMATIC", "PREFILL_STAGES", "MIN_WEIGHT_BYTES"),
            "pdl.py": ("ENABLED",), "cuda_attention.py": ("INVARIANT_MAX_CONTEXT", "SPLIT_KEYS")}
    for name, constants in gone.items():
        text = (ROOT / "cudflash" / "backends" / name).read_text()
        for constant in constants:
            assert not re.search(rf"^{constant}\s*=", text, flags=re.M), (name, constant)
