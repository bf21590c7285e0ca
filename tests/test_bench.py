"""`cudflash bench` on the CPU backend: the JSON contract and the consistency of its own numbers."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cudflash.bench import BatchResult, format_table, write_synthetic_configs
from cudflash.draft_config import load_draft_config


def test_synthetic_bench_writes_consistent_numbers(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "cudflash", "bench", "--synthetic", "tiny", "--backend", "cpu",
                        "--batch", "1,2", "--prompt-len", "24", "--new", "3", "--warmup", "1", "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "projection at tau 6.5" in r.stdout  # synthetic tokens/s are labelled as projections
    data = json.loads(out.read_text())
    assert data["backend"] == "cpu" and data["model"] == "tiny"
    assert [x["batch"] for x in data["results"]] == [1, 2]
    for x in data["results"]:
        assert x["tau"] == 6.5 and not x["tau_measured"]
        parts = x["propose_ms"] + x["verify_ms"] + x["accept_ms"]
        assert abs(parts - x["spec_step_ms"]) < 1e-6 * max(1.0, x["spec_step_ms"]) + 1e-3
        assert x["ar_tokens_per_s"] == x["batch"] / x["ar_step_ms"] * 1e3
        assert x["spec_tokens_per_s"] == x["batch"] * 6.5 / x["spec_step_ms"] * 1e3
        assert x["prefill_ms"] > 0 and x["ar_step_ms"] > 0


@pytest.mark.parametrize("drafter", ["dflash2", "dspark"])
def test_synthetic_bench_takes_another_drafter_family(tmp_path, drafter):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "cudflash", "bench", "--synthetic", "tiny", "--drafter", drafter,
                        "--backend", "cpu", "--prompt-len", "16", "--new", "2", "--warmup", "1", "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["drafter"] == drafter and data["results"][0]["spec_step_ms"] > 0
    _, draft_dir = write_synthetic_configs("qwen3-8b", tmp_path / "pair", drafter)
    cfg = load_draft_config(draft_dir)
    assert cfg.kind == drafter and cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.block_size == 16


def test_bench_drafter_family_needs_a_synthetic_pair(tiny_pair):
    r = subprocess.run([sys.executable, "-m", "cudflash", "bench", "--target", str(tiny_pair / "target"), "--draft",
                        str(tiny_pair / "drafter"), "--drafter", "dspark", "--backend", "cpu"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--drafter" in r.stderr and "Traceback" not in r.stderr


def test_bench_with_a_real_pair_measures_tau(tiny_pair, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "cudflash", "bench", "--target", str(tiny_pair / "target"), "--draft",
                        str(tiny_pair / "drafter"), "--backend", "cpu", "--prompt-len", "32", "--new", "3",
                        "--warmup", "1", "--json", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    x = json.loads(out.read_text())["results"][0]
    assert x["tau_measured"] and 1.0 <= x["tau"] <= 16.0


def test_bench_target_alone_times_plain_decoding(tiny_pair, tmp_path, capsys):
    from cudflash.cli import main

    out = tmp_path / "bench.json"
    main(["bench", "--target", str(tiny_pair / "target"), "--backend", "cpu", "--prompt-len", "16", "--new", "2",
          "--warmup", "1", "--batch", "1,2", "--json", str(out)])
    table = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["drafter"] is None and [x["batch"] for x in data["results"]] == [1, 2]
    for x in data["results"]:
        assert x["block"] == 1 and x["ar_step_ms"] > 0 and x["ar_tokens_per_s"] == x["batch"] / x["ar_step_ms"] * 1e3
        assert x["spec_step_ms"] is None and x["tau"] is None and x["spec_tokens_per_s"] is None
    lines = table.strip().splitlines()
    # head, rule, one row per batch, the copy bandwidth, weight memory, one line of floors (AR only) per batch
    assert "projection" not in table and len(lines) == 8
    memory = next(line for line in lines if line.startswith("weights on the device: target "))
    assert "bf16: " in memory
    assert [line.split(":")[0] for line in lines[-2:]] == ["batch 1 byte floors", "batch 2 byte floors"]
    assert all("AR step" in line and "verify" not in line for line in lines[-2:])
    assert [set(f) for f in data["floors_ms"]] == [{"AR step"}] * 2
    assert data["weights"]["target"]["stored_by_format"]["bf16"] > 0 and "drafter" not in data["weights"]


def test_bench_quantize_fp8_reports_weight_memory_per_format(tiny_pair, tmp_path, capsys):
    from cudflash.cli import main

    out = tmp_path / "bench.json"
    main(["bench", "--target", str(tiny_pair / "target"), "--backend", "cpu", "--prompt-len", "16", "--new", "1",
          "--warmup", "0", "--quantize", "fp8", "--json", str(out)])
    w = json.loads(out.read_text())["weights"]["target"]
    # Every projection in FP8 (1 byte per weight plus its block scales); the tied embedding stays bf16. On the CPU
    # backend every weight is float32 on the "device".
    layers, hidden, inter, kv = 6, 384, 1024, 128
    proj = layers * (hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter)
    assert proj <= w["stored_by_format"]["fp8"] < 1.01 * proj and w["device_by_format"]["fp8"] == 4 * proj
    assert w["stored_by_format"]["bf16"] == 2 * (8192 * hidden + (2 * layers + 1) * hidden + 2 * layers * 64)
    assert "fp8: " in capsys.readouterr().out


def test_table_prints_the_nvml_readings_it_writes():
    """The table carries what the JSON does: power, SM clock and memory in use where NVML answered, and nothing
    invented where it did not (the CPU backend)."""
    row = dict(batch=1, prompt_len=512, block=16, prefill_ms=14.2, ar_step_ms=4.63, propose_ms=0.94, verify_ms=4.64,
               accept_ms=0.0, spec_step_ms=5.58, tau=6.5, tau_measured=False, ar_tokens_per_s=216.0,
               spec_tokens_per_s=1165.0, verify_gb_per_s=3532.0, propose_gb_per_s=3000.0, ar_gb_per_s=3300.0)
    gpu = {"power_w": 412.4, "sm_clock_mhz": 1980, "memory_used_gib": 23.46, "name": "NVIDIA H200"}
    table = format_table([BatchResult(**row, gpu=gpu), BatchResult(**{**row, "batch": 8})], 4250.0)
    assert "batch 1: NVIDIA H200 at 412 W, SM clock 1980 MHz, 23.5 GiB in use" in table
    assert "batch 8:" not in table  # no readings, no line
    assert "measured device copy bandwidth: 4250 GB/s" in table



def test_bench_weights_fp8_needs_synthetic_weights_and_the_gpu(tiny_pair):
    """--weights picks the format of synthetic weights only; on the CPU backend the FP8 weights are refused (they
    are made on the device), before a step runs."""
    r = subprocess.run([sys.executable, "-m", "cudflash", "bench", "--target", str(tiny_pair / "target"), "--weights",
                        "fp8", "--backend", "cpu"], capture_output=True, text=True)
    assert r.returncode == 2 and "--weights" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "cudflash", "bench", "--synthetic", "tiny", "--weights", "fp8",
                        "--backend", "cpu", "--prompt-len", "8", "--new", "1"], capture_output=True, text=True)
    assert r.returncode != 0 and "needs the cuda backend" in r.stderr
    r = subprocess.run([sys.executable, "-m", "cudflash", "bench", "--synthetic", "tiny", "--quantize-draft",
                        "--backend", "cpu"], capture_output=True, text=True)
    assert r.returncode == 2 and "--quantize-draft with --synthetic goes with --weights" in r.stderr


def test_a_synthetic_quantized_drafter_needs_the_dflash_layout():
    from cudflash.bench import synthetic_quantized
    from cudflash.errors import BackendError

    class Cuda:
        name = "cuda"

    class Target:
        layers = []

    class OtherDrafter:
        layers = []

    with pytest.raises(BackendError, match="OtherDrafter"):
        synthetic_quantized(Target(), Cuda(), "fp8", draft=OtherDrafter())


def test_phase_floors_are_bytes_over_the_copy_bandwidth():
    from cudflash.bench import StepBytes, format_floors, phase_bytes, phase_floors_ms

    r = BatchResult(batch=1, prompt_len=512, block=16, prefill_ms=20.0, ar_step_ms=4.0, propose_ms=1.0, verify_ms=4.4,
                    accept_ms=0.1, spec_step_ms=5.5, tau=6.5, tau_measured=False, ar_tokens_per_s=250.0,
                    spec_tokens_per_s=1182.0, verify_gb_per_s=3600.0, propose_gb_per_s=3000.0, ar_gb_per_s=3800.0)
    dense = StepBytes(target_weights=8_000_000_000, draft_weights=3_000_000_000, kv_per_position=0,
                      draft_kv_per_position=0, state_bytes=0, context=512, draft_context=0, block=16)
    n = phase_bytes(dense, 1)
    f = phase_floors_ms(r, n, copy_gb_s=4000.0)
    assert f == {"AR step": 2.0, "verify": 2.0, "propose": 0.75, "spec step": 2.75}
    line = format_floors([r], [f], [n])
    assert "AR step 2.000 ms = 8.000 GB (x2.00)" in line and "verify 2.000 ms" in line and "(x2.20)" in line
    assert "spec step 2.750 ms" in line
    plain = dataclasses_replace(r)
    assert set(phase_floors_ms(plain, n, 4000.0)) == {"AR step"}
    # A hybrid's state: AR reads and writes it, a verify only reads it, the commit (in the spec step) writes it.
    hybrid = phase_bytes(StepBytes(100, 10, kv_per_position=2, draft_kv_per_position=1, state_bytes=1000,
                                   context=50, draft_context=100, block=16), batch=3)
    assert hybrid == {"AR step": 100 + 3 * (100 + 2 + 2000), "verify": 100 + 3 * (100 + 32 + 1000),
                      "propose": 10 + 3 * 100, "spec step": 100 + 3 * 1132 + 310 + 3000}


def dataclasses_replace(r: BatchResult) -> BatchResult:
    import dataclasses

    return dataclasses.replace(r, propose_ms=None, verify_ms=None, accept_ms=None, spec_step_ms=None)
