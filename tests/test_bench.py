"""`cudflash bench` on the CPU backend: the JSON contract and the consistency of its own numbers."""
from __future__ import annotations

import json
import subprocess
import sys


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


def test_bench_with_a_real_pair_measures_tau(tiny_pair, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "cudflash", "bench", "--target", str(tiny_pair / "target"), "--draft",
                        str(tiny_pair / "drafter"), "--backend", "cpu", "--prompt-len", "32", "--new", "3",
                        "--warmup", "1", "--json", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    x = json.loads(out.read_text())["results"][0]
    assert x["tau_measured"] and 1.0 <= x["tau"] <= 16.0


def test_bench_target_needs_a_drafter(tiny_pair):
    r = subprocess.run([sys.executable, "-m", "cudflash", "bench", "--target", str(tiny_pair / "target")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().endswith("cudflash: error: bench --target needs --draft")
