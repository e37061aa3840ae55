#!/usr/bin/env bash
# Every GPU check and benchmark of trainrec in one run (the device machine: torch, Triton, pytest there;
# trainrec's other requirements carried as wheels in .whl/). Results under $OUT (or ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
# trainrec from this checkout without installing it: its folders as the trainrec namespace package
mkdir -p /tmp/pkg/trainrec
for d in schema recorder replay analyzers tools; do ln -sfn "$PWD/$d" "/tmp/pkg/trainrec/$d"; done
export PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== tests on the GPU (compiled Triton kernels)"
timeout 300 python3 -m pytest -q -p no:cacheprovider -x tests/recorder/test_stats_triton.py 2>&1 | tee "$OUT/tests.txt" | tail -25
echo "== benchmark"
timeout 420 python3 benchmarks/bench_gpu.py --json "$OUT/bench_gpu.json" "$@" 2>&1 | grep -v USDT | tee "$OUT/bench.txt"
