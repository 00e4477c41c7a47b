#!/usr/bin/env bash
# The session's closing device runs (the `device` tool), in two commands of under 10 minutes each:
#   bash bench/gpu_final.sh tests   # GPU tests: frontend on Python 3.12, Triton, CUDA graphs, optimizers,
#                                   # the Triton OpInfo subset (float32, bfloat16); autograd peak memory
#   bash bench/gpu_final.sh bench   # bench/gpu.py: eager, Inductor and ember on every row but the training one
#   bash bench/gpu_final.sh train   # the densenet121 training row (Inductor's compile alone takes ~3 minutes)
#   (bench/gpu.py --only splits at commas: a row name with a comma is matched by a part of it; the table
#   rows are timed in 3 more rounds in turns, the diagnostic modes below time once: --rounds 0)
#   bash bench/gpu_final.sh table   # bench, then the training row with Inductor's column, in one command
#   bash bench/gpu_final.sh final   # all of it in one command (tests of what changed, bench, training row)
#   bash bench/gpu_final.sh profile # where the time goes: eager and ember on the model rows, kernel and host profiles
#   bash bench/gpu_final.sh diag    # host split and cold-compile profiles of the host-bound rows, Triton pool
#   bash bench/gpu_final.sh quick   # while working: optimizer/CUDA-graph tests, Adam rows with a kernel profile
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
# ember's bytecode compiled ahead, as `pip install` does for an installed package (torch's and Triton's are): the
# tree copied to the device machine has no __pycache__, and each lazily imported module was compiled from source
# inside the cold compile of the first row that imported it
python3 -m compileall -q ember > /dev/null
export PYTHONPATH=/tmp/site:$PWD EMBER_CACHE_DIR=/tmp/ember_cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "${1:-tests}" in
tests)
  timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/frontend tests/test_rules.py tests/runtime \
    tests/codegen/test_triton.py tests/codegen/test_triton_opinfo.py tests/codegen/test_hfuse.py 2>&1 \
    | tee "$OUT/tests.log" | grep -E "passed|failed|FAIL|Error" | tail -25
  timeout 150 python3 bench/autograd.py --device cuda --no-inductor 2>&1 | grep -v Warn | tee "$OUT/autograd.log" | tail -7 ;;
bench)
  timeout 580 python3 bench/gpu.py --rounds 3 --only pointwise,"adam step","128px infer",resnet50,"bertmodel b8 s128 inference$",gpt2 \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -v -i warn | tail -22 ;;
train)
  timeout 580 python3 bench/gpu.py --rounds 3 --only "train step" --columns "${2:-eager,inductor-train,ember}" 2>&1 | tee "$OUT/train.log" \
    | grep -v -i warn | tail -8 ;;
table)   # the closing table in one command of under 10 minutes: every row, then the training row with Inductor's
  # column (its compile alone takes ~2.7 minutes), each bench/gpu.py with its log and JSON
  timeout 300 python3 bench/gpu.py --rounds 3 --only pointwise,"adam step","128px infer",resnet50,"bertmodel b8 s128 inference$",gpt2 \
    --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  grep -E "^\||^#|Error" "$OUT/bench.log" | tail -14
  timeout 285 python3 bench/gpu.py --rounds 3 --only "train step" --columns eager,inductor-train,ember \
    --json "$OUT/train.json" > "$OUT/train.log" 2>&1
  grep -E "^\||rounds|Error" "$OUT/train.log" | tail -8 ;;
final)   # one command for a session's last ~10 device minutes: the GPU tests of what changed, then every bench row
  # (the training row without Inductor's column: its compile alone takes ~3.5 minutes; `train` with
  # --columns eager,inductor-train,ember measures it)
  timeout 120 python3 -m pytest -q -n 8 -p no:cacheprovider tests/codegen/test_triton.py tests/runtime \
    tests/frontend/test_optimizers.py tests/codegen/test_hfuse.py ${EXTRA_TESTS:-} 2>&1 \
    | tee "$OUT/tests.log" | grep -E "passed|failed|^E  |FAILED" | head -20
  timeout 450 python3 bench/gpu.py --rounds 3 --only pointwise,affine,"adam step","128px infer",resnet50,"bertmodel b8 s128 inference$",gpt2,"train step" \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -v -i warn | grep -E "^\||^#|Error" | tail -22 ;;
profile)   # kernel profiles (GPU time per kernel) and ember's host profile on the model rows, no Inductor
  timeout 100 python3 -m pytest -q -n 8 -p no:cacheprovider ${TESTS:-tests/codegen/test_layout.py tests/frontend/test_meta.py} \
    2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|^E  |FAILED" | head -20
  timeout 440 python3 bench/gpu.py --rounds 0 --only "${ROWS:-resnet50,bert,gpt2,train step}" --columns "${COLUMNS:-eager,ember}" \
    --profile "${ROWS:-resnet50,bert,gpt2,train step}" > "$OUT/profile.log" 2>&1
  grep -E "^\||profile |Error|eagerly" "$OUT/profile.log" | tail -30
  if [ -n "${ROWS2:-}" ]; then   # a second set of rows, e.g. with Inductor's column
    timeout 300 python3 bench/gpu.py --rounds 0 --only "$ROWS2" --columns "${COLUMNS2:-inductor}" --profile "$ROWS2" \
      > "$OUT/profile2.log" 2>&1
    grep -E "^\||profile |Error" "$OUT/profile2.log" | tail -12
  fi ;;
compile)   # where cold compiles go (cProfile of ember's first calls) and host time per step, no Inductor
  timeout 560 python3 bench/gpu.py --rounds 0 --only "${ROWS:-adam step,resnet50,bertmodel b8 s128 inference$,gpt2}" \
    --columns "${COLUMNS:-eager,ember}" --profile "${PROFILE_ROWS:-adam step,resnet50}" \
    --compile-profile "${ROWS:-adam step,resnet50,bertmodel,gpt2}" > "$OUT/compile.log" 2>&1
  grep -E "^\||host |profile |Error" "$OUT/compile.log" | tail -30 ;;
workers)   # Triton kernels compiled in worker processes (ember/runtime/triton_workers.py): their tests and the
  # Triton tests, then ember's cold compile of the training row without them (WORKERS_FROM past every graph's
  # kernel count) and with them
  timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/runtime tests/codegen/test_triton.py ${EXTRA_TESTS:-} \
    2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|^E  |FAILED" | head -20
  for from in 1000000000 4; do
    timeout 200 python3 -c "import sys, runpy; sys.argv = ['bench/gpu.py', '--only', '${ROWS:-train step}', '--columns', 'ember']
import ember.codegen.triton as t; t.WORKERS_FROM = $from; print('WORKERS_FROM', t.WORKERS_FROM)
runpy.run_path('bench/gpu.py', run_name='__main__')" 2>&1 | tee -a "$OUT/workers.log" | grep -E "^\||WORKERS|cold|Error"
  done ;;
check)   # while working: GPU tests of the optimizer/Triton/CUDA-graph paths, Adam rows against Inductor, GPT-2's
  # kernel profile and the source of its slowest Triton kernels (TOP of them)
  timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/codegen/test_triton.py tests/runtime \
    tests/frontend/test_optimizers.py tests/codegen/test_hfuse.py ${EXTRA_TESTS:-} 2>&1 \
    | tee "$OUT/tests.log" | grep -E "passed|failed|^E  |FAILED" | head -30
  timeout 150 python3 bench/gpu.py --rounds 0 --only "Adam step" --columns eager,inductor,ember --profile "${ADAM_PROFILE:-none}" \
    2>&1 | tee "$OUT/adam.log" | grep -v -i warn | grep -E "^\||Error|host Adam" | tail -14
  timeout 150 python3 bench/gpu.py --rounds 0 --only gpt2 --columns ember --profile gpt2 > "$OUT/gpt2.log" 2>&1
  grep -E "^\||profile |Error" "$OUT/gpt2.log" | tail -6
  TOP=${TOP:-6} timeout 120 python3 bench/gpu_gpt2_diag.py > "$OUT/gpt2_diag.log" 2>&1; tail -3 "$OUT/gpt2_diag.log" ;;
diag)   # where host and cold-compile time go: GPU tests of what changed, the Triton compile pool, the host split
  # (frontend alone, host program alone) of the host-bound rows, cProfile of ember's cold compiles
  timeout 100 python3 -m pytest -q -n 8 -p no:cacheprovider tests/codegen/test_triton.py tests/runtime \
    tests/frontend/test_optimizers.py tests/codegen/test_hfuse.py ${EXTRA_TESTS:-} 2>&1 \
    | tee "$OUT/tests.log" | grep -E "passed|failed|^E  |FAILED" | head -20
  timeout 200 python3 bench/gpu_compile_pool.py ${POOL_ROWS:-resnet50 bert} 2>&1 | tee "$OUT/pool.log" | tail -8
  timeout 150 python3 bench/gpu_host_diag.py ${HOST_ROWS:-adam bert} --no-conv ${HOST_FLAGS:-} > "$OUT/host.log" 2>&1
  grep -E "^#|host .*queued|alone" "$OUT/host.log"
  timeout 150 python3 bench/gpu.py --rounds 0 --only "${ROWS:-adam step,resnet50,bertmodel b8 s128 inference$}" --columns ember \
    --compile-profile "${COMPILE_PROFILE:-adam step,resnet50,bertmodel}" > "$OUT/compile.log" 2>&1
  grep -E "^\||compile profile|Error" "$OUT/compile.log" | tail -12 ;;
quick)   # a check while working: optimizer and CUDA-graph tests, the Adam rows with a kernel profile
  timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/codegen/test_triton.py tests/runtime \
    tests/frontend/test_optimizers.py tests/codegen/test_hfuse.py 2>&1 \
    | tee "$OUT/tests.log" | grep -E "passed|failed|^E  |FAILED" | head -30
  timeout 150 python3 bench/gpu.py --rounds 0 --only "Adam step" --columns "${2:-eager,ember}" --profile "Adam step" 2>&1 \
    | tee "$OUT/adam.log" | grep -v -i warn | grep -E "^\||ember\]|Error" | tail -12
  timeout 200 python3 bench/gpu.py --rounds 0 --only "train step" --columns ember 2>&1 | tee "$OUT/train.log" \
    | grep -v -i warn | grep -E "^\||Error|File" | tail -20 ;;
esac
