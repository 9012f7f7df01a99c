#!/usr/bin/env bash
# One prepared GPU run (device tool): the CUDA checks and the benches for the
# qwen3-0.6b shape in bf16. Needs the wheels from ../shared/scripts/gpu-wheels.sh
# in .whl/ (carry it). Writes everything under $OUT. Each part reports its
# failure and the script goes on with the rest.
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
  && export PYTHONPATH=$PWD/.site:$PWD:${PYTHONPATH:-}
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "from sglang.srt.mem_cache.radix_cache import RadixCache; print('sglang ok')" > "$OUT/import.txt" 2>&1 \
  || { cat "$OUT/import.txt"; echo "sglang import failed"; }
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/tests_gpu.txt" 2>&1; tail -5 "$OUT/tests_gpu.txt"
timeout 200 python3 bench/engine.py --device cuda --model qwen3-0.6b --contexts 1024,8192,32768 --steps 3 --reps 3 \
  > "$OUT/bench_engine.txt" 2>&1; tail -6 "$OUT/bench_engine.txt"
cp bench/results/engine.json "$OUT/engine_cuda.json" 2>/dev/null; cp bench/results/engine.png "$OUT/engine_cuda.png" 2>/dev/null
echo "done: $(ls "$OUT")"
