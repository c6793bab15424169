#!/usr/bin/env bash
# SHA-256 of every output file of the bundled example model for all six
# --hessian kinds and the three exports (CPU backend), report.json reduced to
# its time-free fields. Used to show that a refactor leaves outputs
# byte-identical: run before and after, diff the two lists.
#   scripts/output_hashes.sh BAKRON_BINARY > hashes.txt
set -euo pipefail
bk=${1:?usage: output_hashes.sh BAKRON_BINARY}
root="$(cd "$(dirname "$0")/.." && pwd)"
model="$root/examples/kerneldocs-1.6m"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for h in rtn gptq mlplocal-kfac mlplocal-shampoo fullylocal-kfac fullylocal-shampoo; do
    for e in native dequantized gptq; do
        args=(--levels 3)
        [ "$e" = gptq ] && args=(--bits 4 --group 64)
        out="$work/$h-$e"
        "$bk" quantize "$model" --calib "$model/calib.safetensors" --samples 32 \
            --hessian "$h" --export "$e" "${args[@]}" --backend cpu --out "$out" >/dev/null 2>&1 \
            || { echo "$h $e: quantize failed" >&2; exit 1; }
        (cd "$out" && for f in $(ls | sort); do
            if [ "$f" = report.json ]; then
                # drop times, dates, paths and the device line
                printf '%s  %s/%s\n' "$(python3 -c '
import json,sys
r=json.load(open(sys.argv[1]))
def strip(x):
    if isinstance(x,dict):
        return {k:strip(v) for k,v in x.items() if not (k.startswith("t_") or k.endswith("_s") or k in ("time","times","date","device","model_dir","out_dir","calib","calib_path","elapsed","stage_times","version","commit"))}
    if isinstance(x,list): return [strip(v) for v in x]
    return x
print(__import__("hashlib").sha256(json.dumps(strip(r),sort_keys=True).encode()).hexdigest())
' "$f")" "$h-$e" "$f"
            else
                printf '%s  %s/%s\n' "$(sha256sum "$f" | cut -d' ' -f1)" "$h-$e" "$f"
            fi
        done)
    done
done
