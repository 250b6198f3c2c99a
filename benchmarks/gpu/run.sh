#!/bin/bash
# Every GPU check, in one command for a lent GPU machine (the device tool's `run`), from the
# repository root; figures into $OUT (default /tmp/gpu-out). The machine's own python3 holds
# torch, timm and transformers; vitlab runs from src/ (nothing is installed):
#   1. cuda_speed.py: vitlab against timm and transformers, same weights, training and inference;
#   2. `vitlab train` on digits on the GPU end to end (bf16 by `auto`), then `vitlab eval` there
#      and on the CPU: the same checkpoint's accuracy on both devices.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
    nproc
} 2>&1 | tee "$OUT/env.txt"
timeout 330 python3 benchmarks/gpu/cuda_speed.py --rounds 10 --json "$OUT/cuda_speed.json" \
    2>&1 | grep -v "Loading weights" | tee "$OUT/cuda_speed.log"
run=/tmp/gpu-digits
SECONDS=0
timeout 150 python3 -m vitlab train --out $run --overwrite train.device=cuda 2>&1 \
    | tr '\r' '\n' | grep -v "it/s\]$" | tail -25 | tee "$OUT/train.log"
echo "train wall seconds: $SECONDS" | tee -a "$OUT/train.log"
for device in cuda cpu; do
    timeout 60 python3 -m vitlab eval $run --device $device --json 2>/dev/null \
        | python3 -c "import json,sys; r=json.load(sys.stdin); print('$device', r['top1'], r['loss'])"
done 2>&1 | tee "$OUT/eval.log"
