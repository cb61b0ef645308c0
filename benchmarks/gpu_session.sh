#!/usr/bin/env bash
# One device-machine session: install, build the peers (if their sources are in .peers/:
# benchmarks/fetch_peers.sh puts them there),
# run the GPU tests, then the benchmark. Logs and JSON go to $OUT (or ./gpu-out).
# Usage: bash benchmarks/gpu_session.sh [bench args...]
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/megablocks-reference \
  -e plugins/megablocks-triton > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
# megablocks-cuda: builds its extension ahead of time here (torch + nvcc present), ~90 s.
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 -m pip install -q --no-deps --no-build-isolation \
  -e plugins/megablocks-cuda > "$OUT/cuda_build.log" 2>&1 || tail -20 "$OUT/cuda_build.log"

peers_pid=""
if [ -d .peers ] && [ "${SKIP_PEERS:-0}" != 1 ]; then  # MegaBlocks + stk + grouped_gemm, built here
  ( export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
    for d in .peers/stanford_stk-0.7.1 .peers/grouped_gemm_src .peers/megablocks-0.10.0; do
      python3 -m pip install -q --no-deps --no-build-isolation --no-index "$d" || echo "BUILD FAILED: $d"
    done ) > "$OUT/peers.log" 2>&1 &
  peers_pid=$!
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  MEGABLOCKS_TRITON_TEST_DEVICE=cuda TRITON_INTERPRET=0 timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x \
    ${GPU_TESTS:-tests/test_triton_kernels.py tests/test_triton_launch.py tests/test_triton_gmm.py tests/test_gpu_no_host_sync.py tests/test_cuda_gpu.py tests/test_moe_layer.py tests/test_bench.py} 2>&1 | tee "$OUT/tests.log" | tail -15
fi
[ -n "$peers_pid" ] && { wait "$peers_pid"; tail -3 "$OUT/peers.log"; }
timeout ${BENCH_TIMEOUT:-300} megablocks bench --json "$OUT/bench.json" "$@" 2> "$OUT/bench.err" | tee "$OUT/bench.txt"
tail -3 "$OUT/bench.err"
