#!/usr/bin/env bash
# One prepared GPU run (device tool): the CUDA checks and the benches for the
# qwen3-0.6b shape in bf16, flashinfer attention included. Prepare here:
#   bash ../shared/scripts/gpu-wheels.sh && .venv/bin/python bench/gpu_bundle.py
# which writes .gpu/site.tar.xz (sglang's missing wheels plus a cut-down
# flashinfer, 39 MiB); then run with carry [".gpu"] and timeout_s 590:
#   OUT=$OUT bash bench/gpu.sh
# (Carrying .whl/ instead also works, without flashinfer: its tests then skip.)
# Writes everything under $OUT (at most 8 files come back). Each part reports
# its failure and the script goes on with the rest.
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
if [ -f .gpu/site.tar.xz ]; then
  python3 -c "import tarfile; tarfile.open('.gpu/site.tar.xz').extractall('/tmp')" \
    && export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
    && export PYTHONPATH=$PWD/.site:$PWD:${PYTHONPATH:-}
fi
# flashinfer JIT-builds its kernel at first use: it needs the toolkit's root.
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
  CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); export CUDA_HOME
fi
{ nvidia-smi; echo "CUDA_HOME=${CUDA_HOME:-}"
  python3 -c "from sglang.srt.mem_cache.radix_cache import RadixCache; print('sglang ok')"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)"; } > "$OUT/env.txt" 2>&1
tail -2 "$OUT/env.txt"
timeout 280 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu > "$OUT/tests_gpu.txt" 2>&1; tail -8 "$OUT/tests_gpu.txt"
timeout 110 python3 bench/engine.py --device cuda --model qwen3-0.6b --contexts 1024,8192,32768 --steps 3 --reps 3 \
  > "$OUT/bench_engine.txt" 2>&1; tail -6 "$OUT/bench_engine.txt"
cp bench/results/engine.json "$OUT/engine_cuda.json" 2>/dev/null
timeout 150 python3 bench/offload.py --device cuda --model qwen3-0.6b --agents 12 --context 2048 \
  > "$OUT/bench_offload.txt" 2>&1; tail -10 "$OUT/bench_offload.txt"
cp bench/results/offload.json "$OUT/offload_cuda.json" 2>/dev/null
cp bench/results/offload.png "$OUT/offload_cuda.png" 2>/dev/null
echo "done: $(ls "$OUT")"
