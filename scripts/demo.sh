#!/usr/bin/env bash
# `make demo`: get Fashion-MNIST (Debian package where apt is usable, else the download), train the
# quick preset, evaluate it, print the run folder. Without Fashion-MNIST: says so, uses digits.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}

have_fashion() { "$BIN/python" -c "import sys, vitlab.data.download as d; sys.exit(d.find_fashion_mnist(None) is None)"; }

if ! have_fashion; then
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo "sudo -n")
    echo "demo: installing Debian's dataset-fashion-mnist ..."
    ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist) \
      || echo "demo: apt could not install dataset-fashion-mnist"
  fi
fi
if have_fashion || "$BIN/python" -c "from vitlab.data.download import find_or_fetch_fashion_mnist as f; f(None)"; then
  config=configs/fashion-mnist-quick.yaml
else
  echo "demo: Fashion-MNIST cannot be had here (no Debian package, no download): training on digits"
  config=configs/digits.yaml
fi
out="runs/demo-$(date +%Y%m%d-%H%M%S)"
"$BIN/vitlab" train --config "$config" --out "$out"
"$BIN/vitlab" eval "$out"
index=$("$BIN/vitlab" analyze "$out" --out "$out/analysis")
echo
echo "run folder: $out"
echo "analysis:   $index (open it in a browser)"
