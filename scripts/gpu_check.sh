#!/usr/bin/env bash
# The CUDA path's proof in one run (issue 35; docs/benchmarks.md, "CUDA (H200)"), on a machine where torch
# already sees a CUDA device and nothing can be downloaded: first, here, `bash scripts/gpu_wheels.sh` (the
# wheels that machine lacks, into .whl); there, from the repository root:
#
#   bash scripts/gpu_check.sh [tests] [bench]     (both by default)
#
# installs the wheels it lacks into a directory on PYTHONPATH (the source tree's src/ before it), then
# runs (a) the tests marked cuda, and the Triton kernels' tests on the device, and (b) the benchmark (scripts/gpu_bench.py: bandwidth, the decode step
# at batch 1 against the weights-read roofline, the engine against its model-only bound, transformers'
# generate_batch), each part under its own timeout: 8 minutes at most in all. Each figure is one JSON
# line ({"figure": ...}); the log (gpu_check.log), the figures (summary.jsonl), the bench's JSON and the
# tests' JUnit XML go to $OUT when it is set (else bench-results/gpu-check). Exits 2 at once, saying why,
# where torch sees no CUDA device; else 0 when every part ran and passed, 1 otherwise.
#
# Environment: PYTHON (python3), TRIOSERVE_WHEELS (.whl), TRIOSERVE_SITE (where the wheels go:
# /tmp/trioserve-site), TRIOSERVE_GPU_MODEL_DIR (the benchmark's model: /tmp/trioserve-gpu-bench/llama-1b).
# TRIOSERVE_GPU_CHECK_DEVICE=cpu is a dry run of this script on a machine without a GPU, so that a slip in
# it costs no GPU time: the same steps, the tests on the CPU (TRIOSERVE_CUDA_TESTS_DEVICE=cpu), the
# benchmark's parts on a tiny model at float32 (gpu_bench.py --tiny), three times the time limits; its
# figures mean nothing.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PYTHON="${PYTHON:-python3}"
DEVICE="${TRIOSERVE_GPU_CHECK_DEVICE:-cuda}"
if [ "$DEVICE" != cuda ] && [ "$DEVICE" != cpu ]; then
    echo "TRIOSERVE_GPU_CHECK_DEVICE: cuda or cpu (got '$DEVICE')" >&2
    exit 2
fi

if [ "$DEVICE" = cuda ] && ! why="$("$PYTHON" -c 'import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees none"' 2>&1)"; then
    echo "no CUDA device: $(printf '%s\n' "$why" | tail -n 1)" >&2
    exit 2
fi

PARTS=" ${*:-tests bench} "
WHEELS="${TRIOSERVE_WHEELS:-.whl}"
SITE="${TRIOSERVE_SITE:-/tmp/trioserve-site}"
MODEL_DIR="${TRIOSERVE_GPU_MODEL_DIR:-/tmp/trioserve-gpu-bench/llama-1b}"
BENCH=(--device cuda --dtype bfloat16)
SLOW=1  # the time limits' multiple
if [ "$DEVICE" = cpu ]; then
    export TRIOSERVE_CUDA_TESTS_DEVICE=cpu
    MODEL_DIR="${TRIOSERVE_GPU_MODEL_DIR:-/tmp/trioserve-gpu-bench/llama-tiny}"
    BENCH=(--device cpu --dtype float32 --tiny)
    SLOW=3
fi
WORK="${OUT:-bench-results/gpu-check}"
mkdir -p "$WORK" "$SITE"
WORK="$(cd "$WORK" && pwd)"
SUMMARY="$WORK/summary.jsonl"
: >"$SUMMARY"
started=$SECONDS
failed=0

part() {  # NAME SECONDS COMMAND...: run it under its own timeout; say how it ended
    local name="$1" limit="$(($2 * SLOW))" code
    shift 2
    echo "=== $name (at most $limit s; $((SECONDS - started)) s so far)"
    timeout -k 10 "$limit" "$@"
    code=$?
    if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
        echo "{\"figure\": \"timed_out\", \"value\": \"$name\", \"after_s\": $limit}" | tee -a "$SUMMARY"
    fi
    if [ "$code" -ne 0 ]; then
        failed=1
        echo "=== $name exited $code"
    fi
    return "$code"
}

install() {  # the wheels whose distribution this machine lacks, into $SITE
    local missing
    mapfile -t missing < <("$PYTHON" - "$WHEELS" <<'EOF'
import importlib.metadata, pathlib, sys

for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    try:
        importlib.metadata.distribution(wheel.name.split("-")[0])
    except importlib.metadata.PackageNotFoundError:
        print(wheel)
EOF
    )
    [ "${#missing[@]}" -gt 0 ] || return 0
    echo "=== installing ${#missing[@]} wheels into $SITE: ${missing[*]##*/}"
    # pip where it works; else unpacked as they are (a wheel of pure Python, or of one platform, is its tree)
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --upgrade \
        --target "$SITE" "${missing[@]}" ||
        "$PYTHON" -c 'import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])' "$SITE" "${missing[@]}"
}

run_tests() {  # (a) the tests marked cuda, in every test file that marks some
    local files
    mapfile -t files < <(grep -l "mark.cuda" tests/test_*.py)
    part "tests marked cuda: ${files[*]}" 130 "$PYTHON" -m pytest -m cuda -p no:randomly -p no:cacheprovider \
        -n 4 -q --junitxml="$WORK/cuda-tests.xml" "${files[@]}"
    "$PYTHON" - "$WORK/cuda-tests.xml" <<'EOF' | tee -a "$SUMMARY"
import json, sys, xml.etree.ElementTree as ET

try:
    suite = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print(json.dumps({"figure": "cuda_tests", "value": None, "error": "no JUnit XML (the run was cut short?)"}))
    sys.exit()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
met = counts["tests"] > 0 and passed == counts["tests"]
print(json.dumps({"figure": "cuda_tests", "value": passed, "unit": "passed", "target": "all", "met": met, **counts}))
EOF
    # The Triton kernels' own tests (the suite runs them under the interpreter), here on the device.
    part "Triton kernels on the device" 60 "$PYTHON" -m pytest -p no:randomly -p no:cacheprovider -n 4 -q \
        tests/test_gpu_triton_attention.py
}

run_bench() {  # (b) the benchmark; the model it needs comes first
    local bench=("$PYTHON" scripts/gpu_bench.py "${BENCH[@]}" --work "$WORK" --summary "$SUMMARY" --model-dir "$MODEL_DIR")
    part "bandwidth and the model" 45 "${bench[@]}" prepare || return 0
    part "decode at batch 1" 45 "${bench[@]}" decode-b1
    part "the engine and its model-only bound" 120 "${bench[@]}" engine
    part "transformers' generate_batch" 75 "${bench[@]}" generate-batch
}

check() {
    echo "=== $("$PYTHON" -c 'import sys, torch
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device (a dry run)"
print("Python", sys.version.split()[0], "torch", torch.__version__, device)')"
    install || { echo "=== the wheels did not install"; return 1; }
    export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"  # the tree's own trioserve first
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    export TRIOSERVE_CACHE_DIR="${TRIOSERVE_CACHE_DIR:-/tmp/trioserve-cache}"
    "$PYTHON" -c 'import trio, trio_websocket, zmq, msgspec, pytest_trio, trioserve.api' ||
        { echo "=== trioserve does not import"; return 1; }
    [[ "$PARTS" != *" tests "* ]] || run_tests
    [[ "$PARTS" != *" bench "* ]] || run_bench
    echo "=== done in $((SECONDS - started)) s; the figures ($SUMMARY):"
    cat "$SUMMARY"
    return "$failed"
}

check 2>&1 | tee "$WORK/gpu_check.log"
exit "${PIPESTATUS[0]}"
