#!/usr/bin/env bash
# The whole GPU check in one go, on a machine with a CUDA device and CuPy:
#   the GPU test suite (ops, models against numpy, goldens), a short generate run, a summary table last.
# Usage: scripts/gpu_check.sh [--per-file]   (the tiny pair is found in ../shared/models or .cache/)
#   --per-file: each tests/gpu file in a process of its own with CUDA_LAUNCH_BLOCKING=1, so a CUDA error (an illegal
#   address is sticky: every later test of the process fails too) names the file and the launch that caused it.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
pair=../shared/models/tiny-code-pair; [ -d "$pair" ] || pair=.cache/tiny-code-pair

if [ "${1:-}" = "--per-file" ]; then
    tests_rc=0
    : > "$out/gpu_tests.log"
    for f in tests/gpu/test_*.py; do
        CUDA_LAUNCH_BLOCKING=1 python3 -m pytest -q -x -p no:cacheprovider "$f" > "$out/$(basename "$f" .py).log" 2>&1
        rc=$?
        echo "$f rc=$rc $(tail -1 "$out/$(basename "$f" .py).log")" | tee -a "$out/gpu_tests.log"
        [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || { tests_rc=$rc;  # 5: all skipped (no GPU)
            grep -m3 -E "Error|error" "$out/$(basename "$f" .py).log"; }
    done
else
    python3 -m pytest -q -s tests/gpu 2>&1 | tee "$out/gpu_tests.log"
    tests_rc=${PIPESTATUS[0]}
fi

python3 -m cudflash generate --backend cuda --target "$pair/target" --draft "$pair/drafter" \
    --prompts <(python3 -c "import json; [print(json.dumps({'prompt_ids': p})) for p in json.load(open('$pair/prompts_dev.json'))['prompts']]") \
    --max-new-tokens 128 --ignore-eos --output "$out/generate.jsonl" 2> "$out/generate.err"
gen_rc=$?

echo
echo "================ cudflash GPU check ================"
# The device machine gets a copy of the tree without .git: the caller may name the commit in CUDFLASH_COMMIT.
echo "commit   ${CUDFLASH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
echo "device   $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
echo "cupy     $(python3 -c 'import cupy; print(cupy.__version__)')"
echo "tests    $(tail -1 "$out/gpu_tests.log")"
grep -E "exact|gpu tau" "$out/gpu_tests.log" | sed 's/^/         /'
echo "generate $(tail -1 "$out/generate.err")"
echo "===================================================="
[ "$tests_rc" -eq 0 ] && [ "$gen_rc" -eq 0 ]
