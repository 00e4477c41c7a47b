#!/usr/bin/env bash
# GPU runs on a device machine, each under 10 minutes, from the repository root with the `bytecode` wheel in .whl/;
# logs and JSON go to $OUT (default /tmp/out).
#   bash bench/device.sh tests          # GPU tests: frontend, Triton, CUDA graphs, the Triton OpInfo subset
#                                       # (float32, bfloat16), hfuse; then bench/autograd.py's peak memory
#   bash bench/device.sh bench [ROWS]   # bench/gpu.py: eager, Inductor and ember on every row but the training one
#                                       # (ROWS: comma-separated parts of row names, instead of that list)
#   bash bench/device.sh train [COLS]   # the densenet121 training row (Inductor's compile alone takes ~3 minutes)
#   bash bench/device.sh table          # bench, then the training row with Inductor's column: the results table
#   bash bench/device.sh final          # tests of what changed (EXTRA_TESTS=...), every row, training without Inductor
#   bash bench/device.sh quick [COLS]   # while working: optimizer/CUDA-graph tests, Adam rows with a kernel profile
#   bash bench/device.sh profile        # kernel and host-op profiles of the model rows (ROWS=, COLUMNS=, TESTS=;
#                                       # ROWS2=, COLUMNS2= a second set, e.g. with Inductor's column)
#   bash bench/device.sh workers        # ember's cold compile of the training row without, then with, Triton's
#                                       # worker processes
#   bash bench/device.sh dynamic        # bench/dynamic.py: loops whose sizes change, eager / Inductor / ember
#   bash bench/device.sh zoo [ARGS]     # bench/zoo.py --device cuda (eval and training rows, each against eager and
#                                       # float64), JOBS rows at once (4), no row started after BUDGET s (470), each
#                                       # row at most ROW_TIMEOUT s (90): fits one command; ARGS go to zoo.py, e.g.
#                                       # --models hf_beit,resnet18 or --shard 2/4 (then zoo.py --merge the JSONs)
#   bash bench/device.sh sweep          # several GPUs: the whole zoo in shards, GPU tests and bench/dynamic.py beside it
#   bash bench/device.sh par            # several GPUs: the commands PAR_0, PAR_1, ... each on its own GPU at once
#   bash bench/device.sh suite [ARGS]   # several GPUs: bench/suite.py --device cuda in shards, one per GPU at once,
#                                       # each pinned to its share of the cores; ARGS go to every shard (--rows ...,
#                                       # --batch 1); each shard's log and JSON in $OUT, the merged table in suite.md
#   bash bench/device.sh ship           # the saved-program tests on the GPU, then bench/ship.py --device cuda (MODELS=,
#                                       # PHASES= to choose; its table, and ship.json after each model, in $OUT)
#   bash bench/device.sh distributed [ARGS]  # bench/distributed.py: DDP and FSDP2 on every GPU (nvidia-h200-x2)
#   bash bench/device.sh ops [ROWS]     # the Triton tests of op kernels (tiles, columns, rows), then bench/ops.py's
#                                       # ROWS (parts of row names; default: those behind Inductor or eager on the
#                                       # H200) at SCALE (4: 64M elements)
#   bash bench/device.sh run SCRIPT [ARGS]   # any bench script with this set-up, e.g.
#                                       # run bench/gpu.py --only "train step" --columns ember --phases
#                                       # run bench/tools/gpu_kernel_configs.py gpt2
# bench/gpu.py --only splits at commas (a row name with a comma is matched by a part of it); the table modes time
# 3 more rounds in turns, the diagnostic modes once (--rounds 0).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
# ember's bytecode compiled ahead, as `pip install` does for an installed package (torch's and Triton's are): the
# copied tree has no __pycache__, and a lazily imported module would otherwise compile inside a timed cold compile
python3 -m compileall -q ember > /dev/null
export PYTHONPATH=/tmp/site:$PWD EMBER_CACHE_DIR=/tmp/ember_cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TABLE_ROWS='pointwise,adam step,128px infer,resnet50,bertmodel b8 s128 inference$,gpt2'
case "${1:-tests}" in
tests)
  timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/frontend tests/test_rules.py tests/runtime \
    tests/codegen/test_triton.py tests/codegen/test_triton_opinfo.py tests/codegen/test_hfuse.py 2>&1 \
    | tee "$OUT/tests.log" | grep -E "passed|failed|FAIL|Error" | tail -25
  timeout 150 python3 bench/autograd.py --device cuda --no-inductor 2>&1 | grep -v Warn | tee "$OUT/autograd.log" | tail -7 ;;
bench)
  timeout 580 python3 bench/gpu.py --rounds 3 --only "${2:-$TABLE_ROWS}" \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -v -i warn | tail -22 ;;
train)
  timeout 580 python3 bench/gpu.py --rounds 3 --only "train step" --columns "${2:-eager,inductor-train,ember}" 2>&1 | tee "$OUT/train.log" \
    | grep -v -i warn | tail -8 ;;
table)   # every row, then the training row with Inductor's column (its compile alone takes ~2.7 minutes)
  timeout 300 python3 bench/gpu.py --rounds 3 --only "$TABLE_ROWS" --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  grep -E "^\||^#|Error" "$OUT/bench.log" | tail -14
  timeout 285 python3 bench/gpu.py --rounds 3 --only "train step" --columns eager,inductor-train,ember \
    --json "$OUT/train.json" > "$OUT/train.log" 2>&1
  grep -E "^\||rounds|Error" "$OUT/train.log" | tail -8 ;;
dynamic)
  timeout 570 python3 bench/dynamic.py --device cuda --timeout 240 2>&1 | tee "$OUT/dynamic.log" \
    | grep -E "^\||^[a-z0-9]+:|^bench" ;;
final)   # the training row without Inductor's column: its compile alone takes ~3.5 minutes (`train` measures it)
  timeout 120 python3 -m pytest -q -n 8 -p no:cacheprovider tests/codegen/test_triton.py tests/runtime \
    tests/frontend/test_optimizers.py tests/codegen/test_hfuse.py ${EXTRA_TESTS:-} 2>&1 \
    | tee "$OUT/tests.log" | grep -E "passed|failed|^E  |FAILED" | head -20
  timeout 450 python3 bench/gpu.py --rounds 3 --only pointwise,affine,"adam step","128px infer",resnet50,"bertmodel b8 s128 inference$",gpt2,"train step" \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -v -i warn | grep -E "^\||^#|Error" | tail -22 ;;
profile)   # GPU time per kernel and ember's host profile on the model rows, no Inductor unless asked
  timeout 100 python3 -m pytest -q -n 8 -p no:cacheprovider ${TESTS:-tests/codegen/test_layout.py tests/ir/test_meta.py} \
    2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|^E  |FAILED" | head -20
  timeout 440 python3 bench/gpu.py --rounds 0 --only "${ROWS:-resnet50,bert,gpt2,train step}" --columns "${COLUMNS:-eager,ember}" \
    --profile "${ROWS:-resnet50,bert,gpt2,train step}" > "$OUT/profile.log" 2>&1
  grep -E "^\||profile |Error|eagerly" "$OUT/profile.log" | tail -30
  if [ -n "${ROWS2:-}" ]; then
    timeout 300 python3 bench/gpu.py --rounds 0 --only "$ROWS2" --columns "${COLUMNS2:-inductor}" --profile "$ROWS2" \
      > "$OUT/profile2.log" 2>&1
    grep -E "^\||profile |Error" "$OUT/profile2.log" | tail -12
  fi ;;
quick)
  timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/codegen/test_triton.py tests/runtime \
    tests/frontend/test_optimizers.py tests/codegen/test_hfuse.py 2>&1 \
    | tee "$OUT/tests.log" | grep -E "passed|failed|^E  |FAILED" | head -30
  timeout 150 python3 bench/gpu.py --rounds 0 --only "Adam step" --columns "${2:-eager,ember}" --profile "Adam step" 2>&1 \
    | tee "$OUT/adam.log" | grep -v -i warn | grep -E "^\||ember\]|Error" | tail -12
  timeout 200 python3 bench/gpu.py --rounds 0 --only "train step" --columns ember 2>&1 | tee "$OUT/train.log" \
    | grep -v -i warn | grep -E "^\||Error|File" | tail -20 ;;
workers)   # without: WORKERS_FROM past every graph's kernel count
  timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/runtime tests/codegen/test_triton.py ${EXTRA_TESTS:-} \
    2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|^E  |FAILED" | head -20
  for from in 1000000000 4; do
    timeout 200 python3 -c "import sys, runpy; sys.argv = ['bench/gpu.py', '--only', '${ROWS:-train step}', '--columns', 'ember']
import ember.backends.triton_backend as t; t.WORKERS_FROM = $from; print('WORKERS_FROM', t.WORKERS_FROM)
runpy.run_path('bench/gpu.py', run_name='__main__')" 2>&1 | tee -a "$OUT/workers.log" | grep -E "^\||WORKERS|cold|Error"
  done ;;
zoo)
  shift
  timeout 590 python3 bench/zoo.py --device cuda --no-torch --jobs "${JOBS:-4}" --budget "${BUDGET:-470}" \
    --timeout "${ROW_TIMEOUT:-90}" --json "$OUT/zoo.json" --log "$OUT/zoo_workers.log" "$@" > "$OUT/zoo.log" 2>&1
  grep -v -E "^  [^ ]+ (eval|train): " "$OUT/zoo.log" | cut -c1-220 | tail -60 ;;
sweep)   # a several-GPU kind (nvidia-h200-x4): bench/zoo.py over every model in shards on GPUs 0..n-2 (JOBS rows
         # at once on each), while the last GPU runs SWEEP_TESTS, then bench/dynamic.py (DYNAMIC_ARGS); every log and
         # JSON in $OUT/sweep.tar.gz, the merged zoo summary and the other tails printed
  W=/tmp/sweep; mkdir -p "$W/dynlogs"
  n=$(nvidia-smi -L | wc -l); shards=${SHARDS:-$((n > 1 ? n - 1 : 1))}   # (SHARDS=n: the tests share the last GPU)
  for i in $(seq 1 $shards); do
    CUDA_VISIBLE_DEVICES=$(((i - 1) % n)) timeout "${ZOO_S:-560}" python3 bench/zoo.py --device cuda --no-torch \
      --jobs "${JOBS:-6}" --budget "${BUDGET:-440}" --timeout "${ROW_TIMEOUT:-90}" --shard "$i/$shards" \
      --json "$W/zoo$i.json" --log "$W/zoo_workers$i.log" ${ZOO_ARGS:-} > "$W/zoo$i.log" 2>&1 &
  done
  export CUDA_VISIBLE_DEVICES=$((n - 1))
  timeout "${TEST_S:-200}" python3 -m pytest -q -n "${TEST_JOBS:-8}" -p no:cacheprovider ${SWEEP_TESTS:-tests/tools tests/backends} \
    > "$W/tests.log" 2>&1
  [ -n "${DYNAMIC_ARGS+x}" ] && timeout "${DYNAMIC_S:-330}" python3 bench/dynamic.py --device cuda --logs "$W/dynlogs" \
    $DYNAMIC_ARGS > "$W/dynamic.log" 2>&1
  wait
  python3 bench/zoo.py --merge "$W"/zoo[0-9]*.json > "$W/zoo_merged.log" 2>&1
  tar czf "$OUT/sweep.tar.gz" -C "$W" .
  grep -E "passed|failed|^FAILED|^ERROR" "$W/tests.log" | tail -15
  grep -E "^\||^[a-z0-9]+:|^bench" "$W/dynamic.log" 2>/dev/null | tail -20
  grep -v -E "^\| " "$W/zoo_merged.log" | cut -c1-220 | tail -40 ;;
par)     # a several-GPU kind: the commands PAR_0, PAR_1, ... at once, each on its own GPU (CUDA_VISIBLE_DEVICES=i,
         # W=/tmp/par for its files), at most PAR_S s each; their logs and files in $OUT/par.tar.gz, the tails printed
  W=/tmp/par; mkdir -p "$W"; export W
  for i in 0 1 2 3 4 5 6 7; do
    v="PAR_$i"
    if [ -n "${!v:-}" ]; then
      CUDA_VISIBLE_DEVICES=$i timeout "${PAR_S:-560}" bash -c "${!v}" > "$W/par$i.log" 2>&1 &
    fi
  done
  wait
  tar czf "$OUT/par.tar.gz" -C "$W" .
  for f in "$W"/par[0-9].log; do echo "== $f"; grep -v -i warn "$f" | cut -c1-250 | tail -"${PAR_TAIL:-25}"; done ;;
suite)   # one shard per GPU, pinned to cores [i*c, (i+1)*c) (c = cores / GPUs): both compilers' worker pools
         # size themselves from the cores they may use; no row started after SUITE_S s is cut (ROW_TIMEOUT per row)
  shift
  n=$(nvidia-smi -L | wc -l); c=$(( $(nproc) / n ))
  for i in $(seq 1 "$n"); do
    CUDA_VISIBLE_DEVICES=$((i - 1)) timeout "${SUITE_S:-570}" taskset -c "$(( (i - 1) * c ))-$(( i * c - 1 ))" \
      python3 bench/suite.py --device cuda --shard "$i/$n" --timeout "${ROW_TIMEOUT:-240}" \
      --json "$OUT/suite$i.json" "$@" > "$OUT/suite$i.log" 2>&1 &
  done
  wait
  grep -h -E "^[a-z0-9_]+ (eval|train) [a-z0-9]+: " "$OUT"/suite[0-9]*.log | cut -c1-250
  python3 bench/suite.py --merge "$OUT"/suite[0-9]*.json 2>&1 | tee "$OUT/suite.md" ;;
ops)
  timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/codegen/test_triton_tiles.py tests/codegen/test_triton.py \
    ${EXTRA_TESTS:-} 2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|^E  |FAILED" | head -20
  timeout 370 python3 bench/ops.py --device cuda --scale "${SCALE:-4}" --json "$OUT/ops.json" \
    --only "${2:-transpose,log_softmax,softmax,sum middle,sum last,masked,cross_entropy,cumsum,pointwise chain}" 2>&1 \
    | tee "$OUT/ops.log" | grep -v -i warn | tail -16 ;;
run)
  shift
  name=$(basename "${1:?usage: bash bench/device.sh run SCRIPT [ARGS]}" .py)
  timeout 580 python3 "$@" 2>&1 | tee "$OUT/$name.log" | grep -v -i warn | tail -40 ;;
ship)
  timeout "${TEST_S:-80}" python3 -m pytest -q -n 4 -p no:cacheprovider tests/frontend/test_saved.py tests/runtime/test_artifacts.py \
    tests/backends/test_triton_program.py -k "${TESTS_K:-triton or gpu or graphed}" 2>&1 | tee "$OUT/tests.log" \
    | grep -E "passed|failed|^E  |FAILED|Error" | head -30
  timeout "${BENCH_S:-230}" python3 bench/ship.py --device cuda --models "${MODELS:-resnet50,bert,gpt2}" --timeout 150 \
    --phases "${PHASES:-ember cold,ember warm,ember loaded,torch.compile cold,torch.compile warm}" \
    --json "$OUT/ship.json" > "$OUT/ship.log" 2>&1
  grep -E "^\||^cuda|^[a-z0-9]+ (ember|torch)|Error|assert" "$OUT/ship.log" | cut -c1-400 | tail -40 ;;
distributed)   # bench/distributed.py on every GPU of the machine (kind nvidia-h200-x2): DDP and FSDP2, eager /
  shift          # torch.compile / ember; ARGS go to the script (--wrappers ddp, --batch 8, --fsdp-root...)
  timeout 460 python3 bench/distributed.py --json "$OUT/distributed.json" "$@" 2>&1 | tee "$OUT/distributed.log" \
    | grep -E "^\||^(ddp|fsdp) |^torch |Error" | tail -30 ;;
*)
  echo "usage: bash bench/device.sh tests|bench [ROWS]|train [COLS]|table|final|quick [COLS]|profile|workers|dynamic|zoo [ARGS]|sweep|par|ship|distributed [ARGS]|suite [ARGS]|run SCRIPT [ARGS]" >&2
  exit 2 ;;
esac
