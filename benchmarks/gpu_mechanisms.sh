#!/usr/bin/env bash
# The GPU mechanism checks, as one script for a lent GPU machine (plain torch + cuda-python there,
# no vLLM): the gpu-marked tests, the CUDA memory pool benchmark and the weight-streaming benchmark
# (a small and a 7B-sized layer), and the stage link's hop, KV exchange and two-stage pipeline
# (benchmarks/stage_link_gpu.py). Docs land in docs/benchmarks/*_gpu*.{json,md} and the test log in
# docs/benchmarks/gpu_tests.log; with $OUT set (the device tool), they are copied there too.
#   bash benchmarks/gpu_mechanisms.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
D=docs/benchmarks
log=$D/gpu_tests.log
nvidia-smi -L
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
$PY -c "import cuda.bindings; print('cuda-bindings', cuda.bindings.__version__)"
timeout 300 $PY -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_memory_pool.py \
    tests/unit/test_streaming.py tests/gpu/test_mechanisms_cuda.py tests/gpu/test_stage_cuda.py 2>&1 | tee "$log"
timeout 200 $PY -m benchmarks.memory_pool --backend cuda --out $D/mechanisms_memory_pool_gpu.json \
    --md $D/mechanisms_memory_pool_gpu.md
timeout 200 $PY -m benchmarks.weight_streaming --device cuda --steps 30 --out $D/mechanisms_weight_streaming_gpu.json \
    --md $D/mechanisms_weight_streaming_gpu.md
timeout 300 $PY -m benchmarks.weight_streaming --device cuda --steps 30 --hidden 4096 --layers 16 \
    --out $D/mechanisms_weight_streaming_gpu_h4096.json --md $D/mechanisms_weight_streaming_gpu_h4096.md
timeout 400 $PY -m benchmarks.stage_link_gpu
if [ -n "${OUT:-}" ]; then cp "$log" $D/*_gpu*.json $D/*_gpu*.md $D/stage_link_gpu.* "$OUT"/ 2>/dev/null; fi
