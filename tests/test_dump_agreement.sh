#!/usr/bin/env bash
# `bakron dump-activations` (native forward) and scripts/dump_activations.py
# (transformers hooks) must agree on the example model. Skipped (77) where
# PyTorch + transformers are not installed.
set -u
B=${BK_BAKRON:?}
SRC=${BK_SOURCE_ROOT:?}
python3 -c "import torch, transformers, safetensors, numpy" 2>/dev/null || { echo "torch/transformers not installed: skipped"; exit 77; }
M=$SRC/examples/kerneldocs-1.6m
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
"$B" dump-activations "$M" --calib "$M/calib.safetensors" --samples 4 --dtype f32 --out "$W/native" || exit 1
python3 "$SRC/scripts/dump_activations.py" "$M" --calib "$M/calib.safetensors" --samples 4 --out "$W/hf" || exit 1
python3 "$SRC/scripts/compare_activations.py" "$W/native" "$W/hf" --tol 1e-4
