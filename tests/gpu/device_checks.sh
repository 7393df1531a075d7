#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine (see docs/testing.md): the CUDA tests, then the
# GEMINI benchmark on the device. Logs go to $OUT (or ./gpu-out).
set -o pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, zmq; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'zmq', zmq.__version__)"
timeout 240 python3 -m pytest tests/gpu tests/scout -v -s -p no:cacheprovider \
  -W ignore::DeprecationWarning -W ignore::FutureWarning 2>&1 | tee "$out/gpu_tests.log"
timeout 270 python3 bench/gemini.py --device cuda --state-mib 1024 --reps 2 --blocks 3 --block-steps 20 \
  2>&1 | tee "$out/gpu_bench.log"
