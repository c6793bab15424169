#!/usr/bin/env bash
# MPI ranks with the GPU stages (issue 18; docs/DISTRIBUTED.md "Data parallel
# on GPUs"), bundled example model, --backend cuda. Suite cuda: exit 77
# without a GPU, without mpirun or in a build without MPI.
#  - mpirun -np 1 and one plain process write the same bytes (gptq,
#    mlplocal-kfac, fullylocal-kfac: every kind of device sum);
#  - -np 2, ordered sums: the same bytes as one process (each rank's GPU
#    stages hold the residual stream of its own sequences). On a machine with one
#    GPU both ranks share it: NCCL refuses two ranks on one device, so the
#    ranks exchange the device sums and weights as host copies over MPI
#    (report.json says which); with two GPUs or more each rank has its own
#    and, in a build with NCCL, the broadcasts go through NCCL;
#  - -np 2, --dist-reduce sum: the same modules, proxy losses of the first
#    layer (same inputs, device sums that differ only by summation order)
#    within 1e-4 of one process, later layers within 2e-2 (a code that rounds
#    the other way changes the next layers' inputs: on the H200 at bbc5eac
#    layer 3's down_proj differed by 1.1e-3); NCCL all-reduce with a GPU per
#    rank, else MPI;
#  - backprop-kfac and backprop-shampoo with the GPU backward flow on each
#    rank's share and the input side on the GPU stages (bwd_input=gpu, the
#    default): the output-gradient Grams combined in host memory (ordered:
#    passed rank to rank, each rank's device Grams starting from the sums of
#    the ranks before), the input side's device sums through the stages' sums
#    like the other kinds'. -np 2 (halving, leaves of 2) and -np 3 (naive)
#    ordered write the same bytes as one process with the default (whose flow
#    hands its Grams to the stages on the device: B = G / N formed there
#    instead of on the host, the same double division); -np 2 sum within 1e-4
#    in the first layer, 2e-2 after; the input side on the GPU stages
#    (report.json's backprop.input_stages); --setting bwd_input=cpu (the input
#    side on the CPU stages) with 2 ranks still the same bytes as one process
#    with that setting;
#  - more ranks than micro-batches: one line, exit 2, no output.
# BK_CUDA_MPI_PART=backprop runs the backprop cases alone.
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
cd "$W" || exit 1
CAL=(--calib "$M/calib.safetensors" --samples 8 --batch 2 --backend cuda)

"$B" quantize "$M" "${CAL[@]}" --hessian gptq --out ref-gptq 2>"$W/probe.err"
rc=$?
cuda_skip $rc "$W/probe.err"
[ $rc = 0 ] || { echo "FAIL: quantize --backend cuda: $(cat "$W/probe.err")"; exit 1; }
if ! command -v mpirun >/dev/null 2>&1; then
    echo "skipped: mpirun not found (openmpi-bin; on the GPU host scripts/device-env.sh)"
    exit 77
fi
if ! "$B" --version | grep -q "MPI: compiled"; then
    echo "skipped: bakron was built without MPI ($("$B" --version))"
    exit 77
fi
"$B" --version
if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_btl_vader_single_copy_mechanism=none # containers without ptrace rights
# equal BLAS thread counts in the plain runs and the ranks (the CPU stages of
# bwd_input=cpu; tests/test_mpi.sh says why)
export OPENBLAS_NUM_THREADS=1
# --bind-to none: a rank keeps every core (the default binds 1-2 ranks to one core each)
MPIRUN=(timeout 600 mpirun --oversubscribe --bind-to none)
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "GPUs: ${NGPU:-?}"

same_bytes() { # what reference output [tolerance [tolerance of the first layer]]
    local what=$1 a=$2 b=$3 tol=${4:-1e-6} tol0=${5:-${4:-1e-6}} f p bad=0
    [ -d "$b" ] || { die "$what: no output"; return; }
    if [ "$tol" = 1e-6 ]; then
        for p in "$a"/*; do
            f=${p##*/}
            [ "$f" = report.json ] && continue
            cmp -s "$p" "$b/$f" || { die "$what: $f differs from one process's"; bad=1; }
        done
    fi
    python3 - "$a/report.json" "$b/report.json" "$tol" "$tol0" <<'EOF' || { die "$what: report.json modules differ"; bad=1; }
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
tol, tol0 = float(sys.argv[3]), float(sys.argv[4])
key = lambda m: (m["layer"], m["module"])
assert [key(m) for m in a["modules"]] == [key(m) for m in b["modules"]]
worst = {}
for x, y in zip(a["modules"], b["modules"]):
    for k in ("loss", "loss_gptq"):
        if x.get(k) is not None:
            d = abs(x[k] - y[k]) / abs(x[k]) if x[k] else abs(y[k])
            worst[x["layer"]] = max(worst.get(x["layer"], 0.0), d)
first = min(worst) if worst else 0
print("  proxy losses, largest relative difference per layer: " +
      ", ".join(f"{l}: {d:.2e}" for l, d in sorted(worst.items())) +
      f" (tolerance {tol0:g} for layer {first}, {tol:g} after)")
for l, d in worst.items():
    assert d <= (tol0 if l == first else tol), (l, d)
EOF
    [ $bad = 0 ] && echo "ok: $what"
}
collectives() { # report.json -> the mpi section's device_collectives
    python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["mpi"].get("device_collectives", ""))' "$1"
}

# BK_CUDA_MPI_PART=backprop: the backprop section alone (a short GPU lease for a
# change that touches only the backprop kinds); default: everything
PART=${BK_CUDA_MPI_PART:-all}
if [ "$PART" != backprop ]; then
# --- one rank = one process --------------------------------------------------------
for h in gptq mlplocal-kfac fullylocal-kfac; do
    [ -d "ref-$h" ] || "$B" quantize "$M" "${CAL[@]}" --hessian "$h" --out "ref-$h" 2>"$W/err" ||
        die "quantize $h: $(tail -3 "$W/err")"
    "${MPIRUN[@]}" -np 1 "$B" quantize "$M" "${CAL[@]}" --hessian "$h" --out "np1-$h" \
        2>"$W/err" || die "np 1 $h: $(tail -3 "$W/err")"
    same_bytes "mpirun -np 1, $h" "ref-$h" "np1-$h"
done

# --- two ranks ------------------------------------------------------------------------
if [ "${NGPU:-0}" -ge 2 ]; then
    echo "two ranks, a GPU each"
else
    echo "two ranks on one GPU: device buffers through host copies over MPI (NCCL needs a GPU per rank)"
fi
for h in gptq mlplocal-kfac fullylocal-kfac; do
    "${MPIRUN[@]}" -np 2 "$B" quantize "$M" "${CAL[@]}" --hessian "$h" --out "np2-$h" \
        2>"$W/err" || { die "np 2 $h: $(tail -3 "$W/err")"; continue; }
    same_bytes "data parallel, 2 ranks, ordered, $h" "ref-$h" "np2-$h"
    echo "  GPU collectives: $(collectives "np2-$h/report.json")"
done
# each rank holds the residual stream of its own sequences only
detail() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("stages_detail", ""))' "$1"; }
if [ -d np2-gptq ]; then
    echo "  one process: $(detail ref-gptq/report.json)"
    echo "  rank 0 of 2: $(detail np2-gptq/report.json)"
    detail np2-gptq/report.json | grep -q "this rank's sequences" ||
        die "2 ranks: the GPU stages do not say they hold this rank's sequences only"
fi
if [ -d np2-gptq ] && [ "${NGPU:-0}" -lt 2 ]; then
    collectives np2-gptq/report.json | grep -q "host copies" ||
        die "two ranks on one GPU: report.json does not say host copies"
fi
if [ -d np2-gptq ] && [ "${NGPU:-0}" -ge 2 ] && "$B" --version | grep -q "NCCL: compiled"; then
    collectives np2-gptq/report.json | grep -q "NCCL" ||
        die "two GPUs with NCCL: report.json does not say NCCL"
fi
"${MPIRUN[@]}" -np 2 "$B" quantize "$M" "${CAL[@]}" --hessian mlplocal-kfac --dist-reduce sum \
    --out np2-sum 2>"$W/err" || die "np 2 sum: $(tail -3 "$W/err")"
[ -d np2-sum ] && same_bytes "data parallel, 2 ranks, sum (rounding only)" ref-mlplocal-kfac np2-sum 2e-2 1e-4
[ -d np2-sum ] && echo "  GPU collectives: $(collectives np2-sum/report.json)"

fi # (PART)

# --- backprop kinds: the GPU backward flow on each rank's share ---------------------------
# Each rank runs the GPU flow over its sequences (the model Fisher's sampled
# labels seeded by the whole set's sequence index); ordered: rank r's device
# Grams start from the output-gradient sums of the ranks before (host copies
# over MPI), the complete sums go to every rank's host accumulator and from
# there to its GPU stages; the input side's device sums (K-FAC's Σ a aᵀ,
# Shampoo's per-module Σ |g_t|² a aᵀ with each rank's own token weights and
# the plain Grams of the GPTQ loss) passed rank to rank like the other kinds'.
# The same bytes as one process. Halving flow with leaves of 2 layers
# (4 micro-batches, 2 ranks), the naive flow over 3 ranks (3 micro-batches of
# 6 sequences, 1 + 1 + 1).
bp_input() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["backprop"]["input_stages"])' "$1"; }
for h in backprop-kfac backprop-shampoo; do
    "$B" quantize "$M" "${CAL[@]}" --hessian "$h" --leaf-size 2 --out "ref-$h" \
        2>"$W/err" || { die "quantize $h: $(tail -3 "$W/err")"; continue; }
    "${MPIRUN[@]}" -np 2 "$B" quantize "$M" "${CAL[@]}" --hessian "$h" --leaf-size 2 \
        --out "np2-$h" 2>"$W/err" || { die "np 2 $h: $(tail -3 "$W/err")"; continue; }
    same_bytes "data parallel, 2 ranks, ordered, $h --leaf-size 2 (GPU flow, GPU input side)" \
        "ref-$h" "np2-$h"
    python3 -c 'import json,sys; assert json.load(open(sys.argv[1]))["backprop"]["device"] == "cuda"' \
        "np2-$h/report.json" || die "np 2 $h: report.json's backprop.device is not cuda"
    [ "$(bp_input "np2-$h/report.json")" = cuda ] ||
        die "np 2 $h: the input side ran on the $(bp_input "np2-$h/report.json") stages, not the GPU's"
    echo "  GPU collectives: $(collectives "np2-$h/report.json")"
done
BP6=(--calib "$M/calib.safetensors" --samples 6 --batch 2 --backend cuda --hessian backprop-shampoo
     --bwd-flow naive --leaf-size 3)
if "$B" quantize "$M" "${BP6[@]}" --out ref-bp6 2>"$W/err"; then
    "${MPIRUN[@]}" -np 3 "$B" quantize "$M" "${BP6[@]}" --out np3-bp6 2>"$W/err" ||
        die "np 3 backprop-shampoo naive: $(tail -3 "$W/err")"
    same_bytes "data parallel, 3 ranks, ordered, backprop-shampoo --bwd-flow naive (GPU flow, GPU input side)" \
        ref-bp6 np3-bp6
else
    die "quantize backprop-shampoo naive: $(tail -3 "$W/err")"
fi
# sum: each rank's Grams and input sums from zero, added in rank order
# (rounding only; the first layer's tolerance as the stages' sum above)
"${MPIRUN[@]}" -np 2 "$B" quantize "$M" "${CAL[@]}" --hessian backprop-shampoo \
    --leaf-size 2 --dist-reduce sum --out np2-bp-sum 2>"$W/err" ||
    die "np 2 sum backprop-shampoo: $(tail -3 "$W/err")"
[ -d np2-bp-sum ] && [ -d ref-backprop-shampoo ] &&
    same_bytes "data parallel, 2 ranks, sum, backprop-shampoo (rounding only)" ref-backprop-shampoo \
        np2-bp-sum 2e-2 1e-4
# the input side on the CPU stages (--setting bwd_input=cpu): with ranks as before
BPC=(--setting bwd_input=cpu)
if "$B" quantize "$M" "${CAL[@]}" "${BPC[@]}" --hessian backprop-kfac --leaf-size 2 \
    --out ref-bpc 2>"$W/err"; then
    "${MPIRUN[@]}" -np 2 "$B" quantize "$M" "${CAL[@]}" "${BPC[@]}" --hessian backprop-kfac \
        --leaf-size 2 --out np2-bpc 2>"$W/err" || die "np 2 bwd_input=cpu: $(tail -3 "$W/err")"
    same_bytes "data parallel, 2 ranks, ordered, backprop-kfac --setting bwd_input=cpu" ref-bpc \
        np2-bpc
    if [ -d np2-bpc ] && [ "$(bp_input np2-bpc/report.json)" != cpu ]; then
        die "np 2 bwd_input=cpu: the input side not on the CPU stages"
    fi
else
    die "quantize backprop-kfac bwd_input=cpu: $(tail -3 "$W/err")"
fi

[ "$PART" = backprop ] && exit $fail

# --- bad input: more ranks than micro-batches ---------------------------------------------
"${MPIRUN[@]}" -np 3 "$B" quantize "$M" --calib "$M/calib.safetensors" --samples 4 --batch 2 \
    --backend cuda --out np3-bad >"$W/out" 2>"$W/err"
rc=$?
[ $rc -ne 0 ] || die "3 ranks, 2 micro-batches: exit 0"
grep -q "micro-batches" "$W/err" || die "3 ranks, 2 micro-batches: $(head -3 "$W/err")"
[ "$(grep -c "micro-batches" "$W/err")" = 1 ] || die "3 ranks, 2 micro-batches: not one line"
[ ! -e np3-bad ] || die "3 ranks, 2 micro-batches: an output folder"
[ $fail = 0 ] && echo "ok: more ranks than micro-batches refused: $(grep micro-batches "$W/err")"

exit $fail
