#!/bin/bash
# The training paths a GPU user takes that run.sh does not: torch.compile, float32, and torchrun
# (NCCL) with one process, each plain `vitlab train` on digits on the GPU; wall seconds and test
# accuracy of each into $OUT/paths.log. Run from the repository root on a lent GPU machine.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
for what in "train.compile=true" "train.precision=fp32" "torchrun"; do
    SECONDS=0
    if [ "$what" = torchrun ]; then
        cmd=(torchrun --nproc_per_node 1 -m vitlab train)
        args=()
    else
        cmd=(python3 -m vitlab train)
        args=("$what")
    fi
    timeout 150 "${cmd[@]}" --out "/tmp/gpu-$SECONDS-${what//[^a-z]/}" train.device=cuda \
        "${args[@]}" 2>&1 | tr '\r' '\n' | grep -E "^vitlab train|^test:|error|Error" | tail -4
    echo "$what: exit ${PIPESTATUS[0]}, ${SECONDS} s wall"
done 2>&1 | tee "$OUT/paths.log"
