#!/usr/bin/env bash
# --resume on the GPU (suite cuda; exit 77 without a GPU): a run with the
# GPU stages (forward passes, Hessians and solves on the device), killed at
# fault points (before a layer's journal line, inside a layer) and by a
# random kill -9, then continued with --resume, writes exactly the bytes of an
# uninterrupted GPU run (report.json: times and the device peak aside); the
# same with --cpu-stages (CPU forward/Hessians, GPU solves). The resumed run
# rebuilds the residual stream by the whole-layer stage with the quantized
# weights (src/quantize_layers.c layer_rebuild), which must give the staged pass's bits.
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
cp -r "$SRC/examples/kerneldocs-1.6m" "$W/m"
cd "$W" || exit 1
"$B" eval m --tokens m/eval.safetensors --samples 2 --backend cuda >/dev/null 2>probe.err
rc=$?
cuda_skip $rc probe.err
CAL=(--calib m/calib.safetensors --samples 16 --seqlen 64 --backend cuda)

same() {
    [ "$(cd "$1" && ls -A)" = "$(cd "$2" && ls -A)" ] || { echo "file lists differ"; return 1; }
    for f in $(cd "$2" && ls -A); do
        if [ "$f" = report.json ]; then
            python3 - "$1/$f" "$2/$f" <<'EOF' || return 1
import json, sys
def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items()
                if not (k.endswith("_s") or k == "peak_device_bytes")}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x
a, b = (strip(json.load(open(p))) for p in sys.argv[1:3])
if a != b:
    print("report.json differs"); sys.exit(1)
EOF
        else
            cmp -s "$1/$f" "$2/$f" || { echo "$f differs"; return 1; }
        fi
    done
}
resume_until_done() {
    for _ in 1 2 3; do
        "$B" quantize m "$@" --out q --resume >/dev/null 2>err && return 0
    done
    die "resume never finished: $(tail -1 err)"
}

configs=(
    "gpu stages gptq native (auto math)|--hessian gptq --levels 3 ${CAL[*]}"
    "gpu stages mlplocal-kfac dequantized fp32|--hessian mlplocal-kfac --levels 3 --export dequantized --gpu-math fp32 ${CAL[*]}"
    "gpu stages fullylocal-shampoo gptq-export tf32|--hessian fullylocal-shampoo --bits 4 --group 64 --export gptq --gpu-math tf32 ${CAL[*]}"
    "gpu stages no-sequential|--hessian mlplocal-kfac --levels 2 --no-sequential ${CAL[*]}"
    "cpu stages + gpu solves|--hessian mlplocal-kfac --levels 3 --cpu-stages ${CAL[*]}"
)
n=0
for c in "${configs[@]}"; do
    name=${c%%|*}
    read -r -a args <<<"${c#*|}"
    n=$((n + 1))
    "$B" quantize m "${args[@]}" --out ref$n >/dev/null 2>err || { die "$name: reference: $(tail -1 err)"; continue; }
    for pt in journal-2 module-16; do
        BK_FAULT_KILL_AT=$pt "$B" quantize m "${args[@]}" --out q >/dev/null 2>&1
        rc=$?
        [ $rc -eq 137 ] || die "$name $pt: not killed (exit $rc)"
        resume_until_done "${args[@]}"
        why=$(same q ref$n) && echo "ok: $name, killed at $pt, resumed: identical" ||
            die "$name $pt: resumed output differs: $why"
        rm -rf q
    done
done
# random kill -9 (first configuration)
read -r -a args <<<"${configs[0]#*|}"
for i in 1 2 3; do
    "$B" quantize m "${args[@]}" --out q >/dev/null 2>&1 &
    pid=$!
    sleep "0.$((RANDOM % 10))"
    kill -9 $pid 2>/dev/null
    wait $pid 2>/dev/null
    [ -d q ] || resume_until_done "${args[@]}"
    why=$(same q ref1) && echo "ok: random kill $i: identical" || die "random kill $i: $why"
    rm -rf q
done
exit $fail
