#!/usr/bin/env bash
# SHA-256 of every output file of the bundled example model (CPU backend) for
# the six local --hessian kinds and backprop-kfac, each with the three exports,
# plus the driver's other paths: --activations, --resume after a kill inside a
# layer, MPI ranks (-np 2, halving and sum; only when mpirun exists);
# report.json reduced to its time-free fields. Used to show that a refactor
# leaves outputs byte-identical: run before and after, diff the two lists.
#   scripts/output_hashes.sh BAKRON_BINARY > hashes.txt
set -euo pipefail
bk=${1:?usage: output_hashes.sh BAKRON_BINARY}
bk=$(realpath "$bk") # (the --activations part runs in the work folder)
root="$(cd "$(dirname "$0")/.." && pwd)"
model="$root/examples/kerneldocs-1.6m"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cal=(--calib "$model/calib.safetensors" --samples 32 --backend cpu)

hashes() { # DIR LABEL: one line per file
    (cd "$1" && for f in $(ls | sort); do
        if [ "$f" = report.json ]; then
            # drop times, dates, paths, the device line and the ranks' memory peaks
            printf '%s  %s/%s\n' "$(python3 -c '
import json,sys
r=json.load(open(sys.argv[1]))
def strip(x):
    if isinstance(x,dict):
        return {k:strip(v) for k,v in x.items() if not (k.startswith("t_") or k.endswith("_s") or k in ("time","times","date","device","model_dir","out_dir","calib","calib_path","elapsed","stage_times","version","commit","peak_host_bytes_per_rank"))}
    if isinstance(x,list): return [strip(v) for v in x]
    return x
print(__import__("hashlib").sha256(json.dumps(strip(r),sort_keys=True).encode()).hexdigest())
' "$f")" "$2" "$f"
        else
            printf '%s  %s/%s\n' "$(sha256sum "$f" | cut -d' ' -f1)" "$2" "$f"
        fi
    done)
}
fail() { echo "$1: failed" >&2; exit 1; }

for h in rtn gptq mlplocal-kfac mlplocal-shampoo fullylocal-kfac fullylocal-shampoo backprop-kfac; do
    for e in native dequantized gptq; do
        args=(--levels 3)
        [ "$e" = gptq ] && args=(--bits 4 --group 64)
        out="$work/$h-$e"
        "$bk" quantize "$model" "${cal[@]}" --hessian "$h" --export "$e" "${args[@]}" \
            --out "$out" >/dev/null 2>&1 || fail "$h $e: quantize"
        hashes "$out" "$h-$e"
    done
done

# --activations (dumped by the same binary; the dump's files too). A relative
# path: config.json names the activations folder.
(cd "$work" && "$bk" dump-activations "$model" "${cal[@]}" --out acts >/dev/null 2>&1) ||
    fail dump-activations
hashes "$work/acts" dump-activations
for h in gptq mlplocal-kfac fullylocal-shampoo; do
    (cd "$work" && "$bk" quantize "$model" --activations acts --backend cpu --hessian "$h" \
        --levels 3 --out "act-$h" >/dev/null 2>&1) || fail "activations $h"
    hashes "$work/act-$h" "activations-$h"
done

# --resume: killed inside a layer (the test hook), then continued
for h in mlplocal-kfac fullylocal-kfac; do
    BK_FAULT_KILL_AT=module-9 "$bk" quantize "$model" "${cal[@]}" --hessian "$h" --levels 3 \
        --out "$work/res-$h" >/dev/null 2>&1 && fail "resume $h: not killed"
    "$bk" quantize "$model" "${cal[@]}" --hessian "$h" --levels 3 --out "$work/res-$h" \
        --resume >/dev/null 2>&1 || fail "resume $h"
    hashes "$work/res-$h" "resume-$h"
done

# MPI ranks (the mpi sums of the stages)
if command -v mpirun >/dev/null 2>&1 && "$bk" --version | grep -q "MPI: compiled"; then
    if [ "$(id -u)" -eq 0 ]; then
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi
    export OMPI_MCA_btl_vader_single_copy_mechanism=none # containers without ptrace rights
    for mode in "" "--dist-reduce sum"; do
        for h in mlplocal-kfac fullylocal-shampoo backprop-kfac; do
            lab="np2-$h${mode:+-sum}"
            # shellcheck disable=SC2086
            timeout 600 mpirun --oversubscribe -np 2 "$bk" quantize "$model" "${cal[@]}" --hessian "$h" \
                --levels 3 $mode --out "$work/$lab" >/dev/null 2>&1 || fail "$lab"
            hashes "$work/$lab" "$lab"
        done
    done
fi
