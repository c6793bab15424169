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
# On a machine without a GPU the CUDA backend would only run on the CPU: build
# the CPU-only configuration (build-cpu/, seconds instead of minutes). CI and
# scripts/test.sh still compile the CUDA backend whenever nvcc is present.
if bk_have_gpu; then
    builddir=build
    bk_log "GPU found: building with the CUDA backend (when nvcc is present) in $builddir"
    bk_build "$builddir"
else
    builddir=build-cpu
    bk_log "no GPU found: building the CPU-only configuration in $builddir (-Dcuda=disabled)"
    bk_build "$builddir" -Dcuda=disabled
fi

model=examples/kerneldocs-1.6m
out=${BAKRON_QUICKSTART_OUT:-out/kerneldocs-1.6m-mlplocal-kfac-2.81bit}

bk_log "bakron inspect $model"
./"$builddir"/bakron inspect "$model" | sed -n '1,20p'

bk_log "bakron quantize $model --hessian mlplocal-kfac --levels 3 -> $out"
./"$builddir"/bakron quantize "$model" --calib "$model/calib.safetensors" \
    --hessian mlplocal-kfac --levels 3 --out "$out" --overwrite

bk_log "perplexity on $model/eval.safetensors"
echo "full precision (BF16):"
./"$builddir"/bakron eval "$model" --tokens "$model/eval.safetensors" | grep -E "perplexity|NLL"
echo "2.81-bit, mlplocal-kfac:"
./"$builddir"/bakron eval "$out" --tokens "$model/eval.safetensors" | grep -E "perplexity|NLL"
bk_log "quantized checkpoint: $out (report: $out/report.json, model card: $out/README.md)"
