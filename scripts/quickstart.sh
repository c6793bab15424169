#!/usr/bin/env bash
# Install what bakron needs, build it, and run the main job on the bundled
# example model (examples/kerneldocs-1.6m): quantize it to 2.81 bits
# (alphabet {-3..3}) with the MLP-local K-FAC two-sided Hessian, then measure
# perplexity before and after on the held-out evaluation tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/common.sh

bk_install_deps
bk_cuda_path
bk_build build

model=examples/kerneldocs-1.6m
out=${BAKRON_QUICKSTART_OUT:-out/kerneldocs-1.6m-mlplocal-kfac-2.81bit}

bk_log "bakron inspect $model"
./build/bakron inspect "$model" | sed -n '1,20p'

bk_log "bakron quantize $model --hessian mlplocal-kfac --levels 3 -> $out"
./build/bakron quantize "$model" --calib "$model/calib.safetensors" \
    --hessian mlplocal-kfac --levels 3 --out "$out" --overwrite

bk_log "perplexity on $model/eval.safetensors"
echo "full precision (BF16):"
./build/bakron eval "$model" --tokens "$model/eval.safetensors" | grep -E "perplexity|NLL"
echo "2.81-bit, mlplocal-kfac:"
./build/bakron eval "$out" --tokens "$model/eval.safetensors" | grep -E "perplexity|NLL"
bk_log "quantized checkpoint: $out (report: $out/report.json)"
