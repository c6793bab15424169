#!/usr/bin/env bash
# Issue 18 on a GPU host, in one command of about 7 minutes (docs/DISTRIBUTED.md):
#   1. the environment: Open MPI (from .debs/ on the offline host, relocated by
#      scripts/device-env.sh), whether mpirun starts as root and offline, NCCL;
#   2. build the CLI and the NCCL test (BK_GPU_BUILD, default build-gpu);
#   3. tests: test_dist_nccl (one process and mpirun -np 1: the NCCL set-up,
#      all-reduce and broadcast on a communicator of one GPU) and
#      tests/test_cuda_mpi.sh (mpirun -np 1 and -np 2 against one process);
#   4. the mpirun -np 1 overhead on the Llama-3-8B shape
#      (scripts/bench_mpi_overhead.sh on the synthetic checkpoint of
#      scripts/make_synthetic_llama.py, gptq, bf16 GEMMs, runs plain / mpirun / plain).
#
#   scripts/gpu_mpi_check.sh OUTDIR
#
# Writes at most 7 files: setup.log tests.log mpi_overhead.txt mpi_overhead.jsonl
# log-run0.txt log-run1.txt log-run2.txt. BK_MPI_STAGES: subset of
# env,build,test,bench (default all).
set -uo pipefail
OUT=${1:?usage: scripts/gpu_mpi_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
STAGES=${BK_MPI_STAGES:-env,build,test,bench}
has() { case ",$STAGES," in *,"$1",*) return 0 ;; esac; return 1; }
if [ -d .debs ] && ! pkg-config --exists libcjson libpcre2-8 libutf8proc 2>/dev/null; then
    # shellcheck source=/dev/null
    source scripts/device-env.sh
fi
export PATH=/usr/local/cuda/bin:$PATH
B=${BK_GPU_BUILD:-build-gpu}
LOG=$OUT/setup.log
status=0
: >"$LOG"

if has env; then
    {
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ); uid $(id -u); commit ${BK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
        nvidia-smi -L 2>&1
        echo "mpirun: $(command -v mpirun || echo 'not found')"
        mpirun --version 2>&1 | head -2
        echo "-- as root without permission (expected: refused):"
        env -u OMPI_ALLOW_RUN_AS_ROOT -u OMPI_ALLOW_RUN_AS_ROOT_CONFIRM timeout 30 mpirun -np 1 true 2>&1 | head -3
        echo "rc=$?"
        echo "-- with --allow-run-as-root (offline: no network is reachable from this host):"
        timeout 60 mpirun --allow-run-as-root -np 2 --oversubscribe hostname 2>&1 | head -5
        echo "-- with OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1:"
        OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 60 mpirun -np 1 hostname 2>&1 | head -3
        echo "-- NCCL:"
        ls -l /usr/local/cuda/include/nccl.h /usr/local/cuda/lib*/libnccl* /usr/lib/x86_64-linux-gnu/libnccl* 2>&1 | head
        python3 -c 'import nvidia.nccl, os; print("wheel:", os.path.dirname(nvidia.nccl.__file__))' 2>&1 | tail -1
    } >>"$LOG" 2>&1
fi
if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_btl_vader_single_copy_mechanism=none

if has build; then
    t0=$(date +%s)
    {
        if [ -d "$B" ]; then
            meson configure "$B" -Dcuda=enabled
        else
            meson setup "$B" -Dcuda=enabled -Dbuildtype=release
        fi | grep -E "MPI|NCCL|CUDA|nccl|mpi" 
        tg="bakron"
        [ -n "$(meson introspect "$B" --targets | grep -o '"test_dist_nccl"')" ] && tg="$tg tests/test_dist_nccl"
        # shellcheck disable=SC2086
        ninja -C "$B" -j "$(nproc)" $tg 2>&1 | tail -5
    } >>"$LOG" 2>&1
    [ -x "$B/bakron" ] || { echo "build: FAILED" | tee -a "$LOG"; tail -20 "$LOG"; exit 1; }
    echo "build: $(( $(date +%s) - t0 )) s; $("$B/bakron" --version)" | tee -a "$LOG"
fi

if has test; then
    T=$OUT/tests.log
    : >"$T"
    if [ -x "$B/tests/test_dist_nccl" ]; then
        echo "== test_dist_nccl, one process" >>"$T"
        timeout 120 "$B/tests/test_dist_nccl" >>"$T" 2>&1; rc1=$?
        echo "== test_dist_nccl, mpirun -np 1" >>"$T"
        timeout 120 mpirun -np 1 "$B/tests/test_dist_nccl" >>"$T" 2>&1; rc2=$?
        echo "dist_nccl: exit $rc1 / $rc2 (0 ok, 77 skipped)" | tee -a "$T"
        [ $rc1 = 0 ] && [ $rc2 = 0 ] || status=1
    else
        echo "dist_nccl: not built (no NCCL in this build)" | tee -a "$T"
    fi
    echo "== tests/test_cuda_mpi.sh" >>"$T"
    t0=$(date +%s)
    BK_BAKRON=$PWD/$B/bakron BK_SOURCE_ROOT=$PWD timeout 300 bash tests/test_cuda_mpi.sh >>"$T" 2>&1
    rc=$?
    echo "cuda_mpi: exit $rc ($(( $(date +%s) - t0 )) s)" | tee -a "$T"
    [ $rc = 0 ] || status=1
fi

if has bench; then
    DIR=${SYN_DIR:-/tmp/syn-8b}
    if [ ! -f "$DIR/config.json" ] || [ ! -f "$DIR/calib.safetensors" ]; then
        t0=$(date +%s)
        python3 scripts/make_synthetic_llama.py "$DIR" --shape 8b --generator torch \
            --calib-seqs 256 --calib-len 2048 2>&1 | tail -1 >>"$LOG"
        echo "synthetic 8b checkpoint: $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
    fi
    BK_BAKRON=$PWD/$B/bakron BENCH_GPU_MATH=${BENCH_GPU_MATH:-bf16} BENCH_TIMEOUT=${BENCH_TIMEOUT:-150} \
        scripts/bench_mpi_overhead.sh "$DIR" "$DIR/calib.safetensors" "$OUT" || status=1
fi
exit $status
