#!/usr/bin/env bash
# Fetch the peers' sources into .peers/ (ignored by git) for benchmarks/gpu_session.sh, which
# builds them on the GPU machine: MegaBlocks 0.10.0, stanford-stk 0.7.1, grouped_gemm 0.3.0.
# Needs a Python with torch installed (the repo's .venv) and access to the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .peers && mkdir -p .peers/tmp && cd .peers
export TORCH_CUDA_ARCH_LIST=9.0
"../$PY" -m pip download -q --no-deps --no-build-isolation --no-binary :all: \
  megablocks==0.10.0 stanford-stk==0.7.1 -d .
# grouped-gemm's metadata step fails without a CUDA torch; --no-clean keeps the unpacked source.
TMPDIR=$PWD/tmp "../$PY" -m pip download -q --no-deps --no-build-isolation --no-clean \
  grouped-gemm==0.3.0 -d . 2>/dev/null || true
mv tmp/pip-download-*/grouped-gemm_* grouped_gemm_src
for f in megablocks-0.10.0.tar.gz stanford_stk-0.7.1.tar.gz; do tar xzf "$f" && rm "$f"; done
rm -rf tmp
# CUDA 13's CUB dropped DeviceScan::{Exclusive,Inclusive}Sum's trailing debug_synchronous argument.
"../$PY" - <<'PATCH'
path = "megablocks-0.10.0/csrc/cumsum.h"
text = open(path).read().replace("stream,\n\t\t\t\t\t    debug_synchronous));", "stream));")
assert "debug_synchronous))" not in text, "cumsum.h changed upstream: patch by hand"
open(path, "w").write(text)
PATCH
ls
