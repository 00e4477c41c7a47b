#!/usr/bin/env bash
# One device run (the `device` tool): frontend tests on the GPU machine's Python 3.12 / torch 2.11, the
# Triton and CUDA-graph tests, then bench/gpu.py. Usage on the device: bash bench/gpu_session.sh [bench --only]
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD EMBER_CACHE_DIR=/tmp/ember_cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/frontend tests/test_rules.py tests/codegen/test_triton.py \
  tests/runtime 2>&1 | tee "$OUT/tests.log" | tail -25
timeout 420 python3 bench/gpu.py --rounds 3 ${1:+--only "$1"} 2>&1 | tee "$OUT/bench.log" | tail -25
