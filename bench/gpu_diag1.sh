python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD EMBER_CACHE_DIR=/tmp/ember_cache PYTHONUNBUFFERED=1
python3 bench/gpu_launch.py 2>&1 | tee $OUT/launch.log
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/codegen/test_triton.py tests/runtime tests/frontend/test_api.py 2>&1 | tail -4
timeout 330 python3 bench/gpu.py --only "infer, default",bert,pointwise --columns eager,ember --profile "infer, default",bert 2>&1 | tee $OUT/bench.log | grep -v Warning | tail -90
