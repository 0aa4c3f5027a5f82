#!/usr/bin/env bash
# Downloads, on a machine with network, every wheel the GPU machine lacks
# (docs/benchmarks.md, "CUDA (H200)"), into DIR (default .whl, which git
# ignores), for scripts/gpu_check.sh to install there with --no-index.
#
#   bash scripts/gpu_wheels.sh [DIR]
#
# The GPU machine's image (Python 3.12) has torch, transformers, tokenizers,
# safetensors, h11, jinja2, prometheus-client, psutil, hypothesis, pytest and
# pytest-xdist, and with them numpy, filelock and huggingface-hub; it has no
# network. What trioserve's engine, its benchmark and its CUDA tests import
# beyond that: trio, trio-websocket, pyzmq, msgspec, pytest-trio, and what they
# require (their wheels' Requires-Dist): outcome, sniffio, sortedcontainers,
# attrs, idna (trio), wsproto (trio-websocket). Those the image may have
# already (attrs, idna, sniffio, sortedcontainers) are downloaded too: they are
# small, and gpu_check.sh installs only the distributions the machine lacks.
# Not downloaded: llguidance (imported on a request's first structured-output
# constraint only), gguf and accelerate (converting the default model only).
# Versions: constraints.txt's where it names the package, else the pins below
# (the versions tested in .venv). Then trioserve itself, as a wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
PIP=(python3 -m pip)
if [ -x .venv/bin/python ]; then
    PIP=(.venv/bin/python -m pip)
fi

# name, and its version when constraints.txt does not name it
WHEELS=(
    "trio" "pyzmq" "msgspec" "trio-websocket" "pytest-trio"
    "outcome 1.3.0.post0" "sniffio 1.3.1" "sortedcontainers 2.4.0" "attrs 26.1.0" "idna 3.20" "wsproto 1.3.2"
)

pinned() {  # NAME -> its version in constraints.txt, or nothing
    sed -n "s/^$1==\([^ #]*\).*/\1/p" constraints.txt | head -n 1
}

mkdir -p "$DIR"
for entry in "${WHEELS[@]}"; do
    read -r name fallback <<<"$entry"
    version="$(pinned "$name")"
    version="${version:-$fallback}"
    if [ -z "$version" ]; then
        echo "gpu_wheels: no version for $name (neither constraints.txt nor this script pins one)" >&2
        exit 1
    fi
    "${PIP[@]}" download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        --platform any -d "$DIR" "$name==$version"
done
rm -f "$DIR"/trioserve-*.whl
# --no-build-isolation: the setuptools at hand builds it (nothing more is downloaded).
"${PIP[@]}" wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w "$DIR" . >/dev/null
wheels=("$DIR"/*.whl)
stat -c '%10s  %n' "${wheels[@]}"
total="$(du -cb "${wheels[@]}" | tail -n 1 | cut -f 1)"
echo "gpu_wheels: ${#wheels[@]} wheels, $total bytes ($((total / 1024)) KiB) in $DIR"
