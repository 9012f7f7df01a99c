#!/usr/bin/env bash
# One prepared GPU run (device tool): the CUDA checks and the benches for the
# qwen3-0.6b shape in bf16. Needs the wheels from ../shared/scripts/gpu-wheels.sh
# in .whl/ (carry it), e.g. run with carry [".whl"], timeout_s 560:
#   OUT=$OUT bash bench/gpu.sh
# Writes everything under $OUT (at most 8 files come back). Each part reports
# its failure and the script goes on with the rest. flashinfer's wheel does not
# fit the transfer beside sglang's, so attention there is SDPA (recorded in the
# engine JSON) and the flashinfer tests skip.
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
  && export PYTHONPATH=$PWD/.site:$PWD:${PYTHONPATH:-}
{ nvidia-smi; python3 -c "from sglang.srt.mem_cache.radix_cache import RadixCache; print('sglang ok')"; } \
  > "$OUT/env.txt" 2>&1; tail -1 "$OUT/env.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu > "$OUT/tests_gpu.txt" 2>&1; tail -8 "$OUT/tests_gpu.txt"
timeout 150 python3 bench/engine.py --device cuda --model qwen3-0.6b --contexts 1024,8192,32768 --steps 3 --reps 3 \
  > "$OUT/bench_engine.txt" 2>&1; tail -6 "$OUT/bench_engine.txt"
cp bench/results/engine.json "$OUT/engine_cuda.json" 2>/dev/null
timeout 180 python3 bench/offload.py --device cuda --model qwen3-0.6b --agents 12 --context 2048 \
  > "$OUT/bench_offload.txt" 2>&1; tail -10 "$OUT/bench_offload.txt"
cp bench/results/offload.json "$OUT/offload_cuda.json" 2>/dev/null
cp bench/results/offload.png "$OUT/offload_cuda.png" 2>/dev/null
echo "done: $(ls "$OUT")"
