# Device run: Triton/CUDA-graph tests, ember vs eager on the GPU workloads, autograd memory column.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD EMBER_CACHE_DIR=/tmp/ember_cache PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/codegen/test_triton.py tests/runtime tests/frontend/test_api.py 2>&1 | tail -4
timeout 150 python3 bench/autograd.py --device cuda --no-inductor 2>&1 | tee $OUT/autograd.log | tail -12
timeout 290 python3 bench/gpu.py --only pointwise,adam,"infer, default","infer, reduce",resnet50,bert,gpt2,"train step" --columns eager,ember --profile "infer, default" 2>&1 | tee $OUT/bench.log | grep -v Warning | tail -40
