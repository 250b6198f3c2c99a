#!/usr/bin/env bash
# Fashion-MNIST from scratch with the two presets, one after the other on an otherwise idle machine:
# wall-clock (the whole command: start-up, data, training, validation, test) and test accuracy.
#   bash benchmarks/fashion_mnist.sh [quick|full|both|nolimit] [key=value ...]
# full: the full preset as it is (30-minute time budget); nolimit: the full preset without its
# budget for 128 epochs, with the one-conv-a-stage stem of its recorded figure (the "no time limit"
# figure; BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
which=${1:-both}
shift || true  # the rest: overrides for every run, e.g. train.threads=1
run() {
  local preset=$1 out="runs/bench-$1-$(date +%Y%m%d-%H%M%S)"
  shift
  mkdir -p runs
  local t0=$SECONDS
  "$BIN/vitlab" train --config "configs/$preset.yaml" --out "$out" "$@" 2> "$out.log" || { tail -5 "$out.log"; exit 1; }
  local wall=$((SECONDS - t0))
  "$BIN/python" - "$out" "$wall" "$preset" <<'PY'
import json, sys
out, wall, preset = sys.argv[1], int(sys.argv[2]), sys.argv[3]
r = json.load(open(f"{out}/results.json"))
print(json.dumps({"preset": preset, "test_top1": round(r["top1"], 4), "wall_s": wall, "run": out}))
PY
}
[ "$which" = quick ] || [ "$which" = both ] && run fashion-mnist-quick "$@"
[ "$which" = full ] || [ "$which" = both ] && run fashion-mnist "$@"
[ "$which" = nolimit ] && run fashion-mnist train.time_budget=null 'model.stem_depths=[]' train.epochs=128 "$@"
true
