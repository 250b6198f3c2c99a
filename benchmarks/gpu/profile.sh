#!/bin/bash
# Where vitlab's and timm's training steps spend their GPU time (profile_step.py), for a lent GPU
# machine (the device tool's `run`), from the repository root; tables into $OUT.
#   Ti/16 in bf16 (cuda_speed.py's one row where vitlab trails timm, 0.97x) and S/16 as a control.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
python3 -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__)" \
    | tee "$OUT/env.txt"
for spec in Ti/16:256 S/16:256; do
    dir="$OUT/${spec//[\/:]/_}"
    timeout 200 python3 benchmarks/gpu/profile_step.py --model "$spec" --precision bf16 \
        --out-dir "$dir" 2>&1 | grep -v "USDT\|Loading weights" | head -12 | tee "$dir.log"
done
