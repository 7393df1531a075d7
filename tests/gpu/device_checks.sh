#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine (see docs/testing.md): the CPU benches on its cores,
# what detection costs the GPU (bench/scout.py --device cuda), the CUDA tests, the GEMINI GPU benchmark.
# Logs go to $OUT (or ./gpu-out). Wheels of packages the machine lacks (pyzmq) may be carried in
# ./.whl: they are installed into /tmp/site first.
set -o pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, zmq, xxhash, pynvml; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'zmq', zmq.__version__)"
# Most needed first; each step gets at most its own limit and what is left of the whole run's
# (BUDGET_S, default 560 s), so that the run ends inside a lease's one call.
budget="${BUDGET_S:-560}"
cap() { local left=$((budget - SECONDS)); if ((left < 10)); then echo 1; elif ((left < $1)); then echo "$left"; else echo "$1"; fi; }
# The CPU figures on this host's cores (a GPU node has more than the 2 of the development VM):
# replication vs raw pyzmq and 4-rank DDP throughput with captures (GEMINI), 4- and 2-rank DDP
# throughput with fingerprints and gossip every step (SCOUT).
timeout "$(cap 150)" python3 bench/gemini.py --reps 2 --blocks 3 --block-steps 20 2>&1 | tee "$out/cpu_gemini.log"
timeout "$(cap 120)" python3 bench/scout.py --throughput-only --blocks 3 2>&1 | tee "$out/cpu_scout.log"
# The same at an LLM-like compute per parameter (2048 rows a rank a step, not 64 or 32).
timeout "$(cap 100)" python3 bench/scout.py --throughput-only --blocks 3 --rows 2048 2>&1 \
  | tee "$out/cpu_scout_rows2048.log"
timeout "$(cap 130)" python3 bench/gemini.py --reps 2 --blocks 5 --block-steps 20 --rows 2048 2>&1 \
  | tee "$out/cpu_gemini_rows2048.log"
timeout "$(cap 60)" python3 bench/scout.py --device cuda --blocks 3 --block-steps 20 2>&1 | tee "$out/gpu_scout.log"
timeout "$(cap 60)" python3 bench/scout.py --device cuda --blocks 3 --block-steps 40 --gpu-bf16 2>&1 \
  | tee "$out/gpu_scout_bf16.log"
timeout "$(cap 200)" python3 -m pytest tests/gpu tests/scout -v -s -p no:cacheprovider \
  -W ignore::DeprecationWarning -W ignore::FutureWarning 2>&1 | tee "$out/gpu_tests.log"
timeout "$(cap 200)" python3 bench/gemini.py --device cuda --state-mib 1024 --reps 2 --blocks 3 --block-steps 20 \
  2>&1 | tee "$out/gpu_bench.log"
