#!/usr/bin/env bash
# MPI ranks (issue 18), CPU backend, bundled example model:
#  - the collectives of bakron/dist.h that the GPU ranks use (tests/test_dist.c,
#    3 ranks and 1): all-gather, minimum, local rank, rank-order sum;
#  - mpirun -np 1 and one plain process write the same bytes;
#  - data parallel (--calib), ordered sums: -np 2 and -np 3 write the same bytes
#    as one process (gptq, fullylocal-shampoo, --no-sequential; backprop-kfac
#    and backprop-shampoo, whose CPU backward flow runs on each rank's share:
#    the sampled labels must be those of the whole set, the output-gradient
#    sums passed from rank to rank);
#  - data parallel, --dist-reduce sum: the same modules with proxy losses
#    within 1e-4 of one process (the sums differ only by rounding);
#  - layer parallel (--activations, and rtn without calibration): -np 3 writes
#    the same bytes as one process;
#  - bad input: ranks started with different arguments, more ranks than
#    micro-batches, --layers with layer-parallel ranks, a backprop kind with
#    ranks and --backend cuda in a build without CUDA, --resume, a rank killed, a rank
#    that hangs (--dist-timeout): rank 0 prints one line, the job exits
#    non-zero, no output folder, no hang.
# Skipped (77) where MPI is not installed or bakron was built without it.
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
if ! command -v mpirun >/dev/null 2>&1; then
    echo "skipped: mpirun not found (install openmpi-bin libopenmpi-dev)"
    exit 77
fi
if ! "$B" --version | grep -q "MPI: compiled"; then
    echo "skipped: bakron was built without MPI ($("$B" --version))"
    exit 77
fi
cd "$W" || exit 1
if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_btl_vader_single_copy_mechanism=none # containers without ptrace rights
# One BLAS thread in the plain runs and in the ranks alike: OpenBLAS's results for
# some calls depend on its thread count, and mpirun binds each rank to one core
# (docs/DISTRIBUTED.md, --dist-reduce ordered). Without this the byte-for-byte
# comparisons below compare two thread counts on machines where that matters.
export OPENBLAS_NUM_THREADS=1
# Under AddressSanitizer (the asan build of the suite) the leak check is off for
# the ranks only: Open MPI's own allocations at exit, in components it has
# already unloaded (unsymbolizable), are reported as leaks. Address and UB
# checks stay on; the single-process runs here keep the leak check.
MPIRUN=(timeout 300 env "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" mpirun --oversubscribe)
CAL=(--calib "$M/calib.safetensors" --samples 8 --batch 2 --backend cpu)

same_bytes() { # what reference output
    local what=$1 a=$2 b=$3 f
    [ -d "$b" ] || { die "$what: no output"; return; }
    for f in $(ls "$a"); do
        [ "$f" = report.json ] && continue
        cmp -s "$a/$f" "$b/$f" || die "$what: $f differs from one process's"
    done
    python3 - "$a/report.json" "$b/report.json" <<'EOF' || die "$what: report.json modules differ"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
# the same modules and damping; the proxy losses (statistics of the solver,
# products on BLAS threads: the ranks run 1 thread each) to 1e-6
key = lambda m: (m["layer"], m["module"], m.get("damp_a"), m.get("damp_b"), m.get("clamped"))
assert [key(m) for m in a["modules"]] == [key(m) for m in b["modules"]]
for x, y in zip(a["modules"], b["modules"]):
    for k in ("loss", "loss_gptq"):
        if x.get(k) is not None:
            assert abs(x[k] - y[k]) <= 1e-6 * abs(x[k]), (k, x, y)
EOF
    echo "ok: $what"
}

# --- the collectives the GPU ranks use (bakron/dist.h), on the CPU ------------------
TD=${BK_BUILD_ROOT:-}/tests/test_dist
if [ -x "$TD" ]; then
    "${MPIRUN[@]}" -np 3 "$TD" >"$W/dist.out" 2>&1 || die "test_dist -np 3: $(tail -3 "$W/dist.out")"
    [ "$(grep -c '^ok: rank' "$W/dist.out")" = 3 ] || die "test_dist -np 3: $(cat "$W/dist.out")"
    "${MPIRUN[@]}" -np 1 "$TD" >"$W/dist.out" 2>&1 || die "test_dist -np 1: $(tail -3 "$W/dist.out")"
    grep -q '^ok: rank 0 of 1' "$W/dist.out" || die "test_dist -np 1: $(cat "$W/dist.out")"
    echo "ok: all-gather, minimum, local rank, rank-order sum (3 ranks and 1)"
else
    die "test_dist not built ($TD)"
fi

# --- one rank = one process ------------------------------------------------------
"$B" quantize "$M" "${CAL[@]}" --hessian mlplocal-kfac --out ref-mlp 2>/dev/null || die "quantize"
"${MPIRUN[@]}" -np 1 "$B" quantize "$M" "${CAL[@]}" --hessian mlplocal-kfac --out np1 \
    2>"$W/err" || die "np 1: $(tail -3 "$W/err")"
same_bytes "mpirun -np 1" ref-mlp np1
python3 -c 'import json,sys; assert json.load(open(sys.argv[1]))["mpi"]["ranks"] == 1' \
    np1/report.json || die "np 1: report.json has no mpi section"

# --- data parallel, ordered sums: the single process's bytes ------------------------
for h in gptq fullylocal-shampoo; do
    "$B" quantize "$M" "${CAL[@]}" --hessian "$h" --out "ref-$h" 2>/dev/null || die "quantize $h"
    "${MPIRUN[@]}" -np 2 "$B" quantize "$M" "${CAL[@]}" --hessian "$h" --out "np2-$h" \
        2>"$W/err" || die "np 2 $h: $(tail -3 "$W/err")"
    same_bytes "data parallel, 2 ranks, $h" "ref-$h" "np2-$h"
done
"${MPIRUN[@]}" -np 3 "$B" quantize "$M" "${CAL[@]}" --hessian mlplocal-kfac --out np3 \
    2>"$W/err" || die "np 3: $(tail -3 "$W/err")"
same_bytes "data parallel, 3 ranks, mlplocal-kfac" ref-mlp np3
# report.json: every rank's peak resident set (getrusage), in rank order
python3 - np3/report.json np1/report.json <<'EOF' || die "report.json: mpi.peak_host_bytes_per_rank"
import json, sys
for path, n in zip(sys.argv[1:], (3, 1)):
    p = json.load(open(path))["mpi"]["peak_host_bytes_per_rank"]
    assert len(p) == n and all(isinstance(x, (int, float)) and x > 1e6 for x in p), (path, p)
    print(f"  peak resident set per rank ({path.split('/')[0]}): " +
          ", ".join(f"{x / 2**20:.1f} MiB" for x in p))
EOF
"$B" quantize "$M" "${CAL[@]}" --hessian fullylocal-kfac --no-sequential --out ref-noseq \
    2>/dev/null || die "quantize --no-sequential"
"${MPIRUN[@]}" -np 2 "$B" quantize "$M" "${CAL[@]}" --hessian fullylocal-kfac --no-sequential \
    --out np2-noseq 2>"$W/err" || die "np 2 --no-sequential: $(tail -3 "$W/err")"
same_bytes "data parallel, 2 ranks, --no-sequential" ref-noseq np2-noseq
# backprop kinds: the halving flow with leaves of 2 layers (2 ranks, 4
# micro-batches each side), the naive flow over 3 ranks with an uneven split
# (3 micro-batches: 1 + 1 + 1 of 6 sequences, --batch 2)
for h in backprop-kfac backprop-shampoo; do
    "$B" quantize "$M" "${CAL[@]}" --hessian "$h" --leaf-size 2 --out "ref-$h" 2>/dev/null ||
        die "quantize $h"
    "${MPIRUN[@]}" -np 2 "$B" quantize "$M" "${CAL[@]}" --hessian "$h" --leaf-size 2 \
        --out "np2-$h" 2>"$W/err" || die "np 2 $h: $(tail -3 "$W/err")"
    same_bytes "data parallel, 2 ranks, $h --leaf-size 2" "ref-$h" "np2-$h"
done
BP6=(--calib "$M/calib.safetensors" --samples 6 --batch 2 --backend cpu --hessian backprop-shampoo
     --bwd-flow naive --leaf-size 3)
"$B" quantize "$M" "${BP6[@]}" --out ref-bp6 2>/dev/null || die "quantize backprop-shampoo naive"
"${MPIRUN[@]}" -np 3 "$B" quantize "$M" "${BP6[@]}" --out np3-bp6 2>"$W/err" ||
    die "np 3 backprop-shampoo naive: $(tail -3 "$W/err")"
same_bytes "data parallel, 3 ranks, backprop-shampoo --bwd-flow naive" ref-bp6 np3-bp6

# --- data parallel, partial sums added in rank order ---------------------------------
"${MPIRUN[@]}" -np 2 "$B" quantize "$M" "${CAL[@]}" --hessian mlplocal-kfac --dist-reduce sum \
    --out sum2 2>"$W/err" || die "np 2 sum: $(tail -3 "$W/err")"
python3 - ref-mlp/report.json sum2/report.json <<'EOF' && echo "ok: --dist-reduce sum within 1e-4" || die "--dist-reduce sum: losses differ"
import json, sys
a, b = (json.load(open(p))["modules"] for p in sys.argv[1:3])
assert len(a) == len(b) == 28
for x, y in zip(a, b):
    assert (x["layer"], x["module"]) == (y["layer"], y["module"])
    assert abs(x["loss"] - y["loss"]) <= 1e-4 * abs(x["loss"]), (x, y)
EOF

# --- layer parallel -------------------------------------------------------------------
"$B" dump-activations "$M" --calib "$M/calib.safetensors" --samples 8 --backend cpu --out acts \
    2>/dev/null || die "dump-activations"
"$B" quantize "$M" --activations acts --backend cpu --hessian mlplocal-kfac --out ref-acts \
    2>/dev/null || die "quantize --activations"
"${MPIRUN[@]}" -np 3 "$B" quantize "$M" --activations acts --backend cpu --hessian mlplocal-kfac \
    --out lp3 2>"$W/err" || die "layer parallel: $(tail -3 "$W/err")"
same_bytes "layer parallel, 3 ranks" ref-acts lp3
ls -a lp3 | grep -q parts && die "layer parallel: the parts were left in the output"
"$B" quantize "$M" --hessian rtn --out ref-rtn 2>/dev/null || die "rtn"
"${MPIRUN[@]}" -np 2 "$B" quantize "$M" --hessian rtn --out lp-rtn 2>"$W/err" ||
    die "layer parallel rtn: $(tail -3 "$W/err")"
same_bytes "layer parallel, rtn, 2 ranks" ref-rtn lp-rtn

# --- bad input ------------------------------------------------------------------------
# A wrapper gives each rank its own stderr (rank 0's is the job's message).
cat >wrap.sh <<'EOF'
#!/usr/bin/env bash
r=${OMPI_COMM_WORLD_RANK:-0}
exec "$@" 2>"err.$r"
EOF
chmod +x wrap.sh
nothing_left() { # what
    ls -a | grep -E '^(bad|\.bad)' && die "$1: left $(ls -a | grep -E '^(bad|\.bad)' | tr '\n' ' ')"
}
refused() { # what expected-exit words -- mpirun args
    local what=$1 want=$2 words=$3; shift 4
    rm -f err.*
    local t0=$SECONDS
    "${MPIRUN[@]}" "$@" >/dev/null 2>mpirun.err; local rc=$?
    [ $rc -ne 0 ] || die "$what: exit 0"
    [ $rc -ne 124 ] || die "$what: hung (killed by timeout)"
    [ "$want" = any ] || [ $rc -eq "$want" ] || die "$what: exit $rc, expected $want"
    [ -f err.0 ] || { die "$what: rank 0 wrote nothing"; return; }
    [ "$(wc -l <err.0)" -eq 1 ] || die "$what: rank 0 did not print one line: $(cat err.0)"
    grep -q -- "$words" err.0 || die "$what: rank 0's line lacks '$words': $(cat err.0)"
    nothing_left "$what"
    echo "refused ($what, exit $rc, $((SECONDS - t0)) s): $(cut -c1-200 err.0)"
}
cat >diffargs.sh <<'EOF'
#!/usr/bin/env bash
r=${OMPI_COMM_WORLD_RANK:-0}
extra=(); [ "$r" = 1 ] && extra=(--damp 0.1)
exec "$@" "${extra[@]}" 2>"err.$r"
EOF
chmod +x diffargs.sh
refused "different arguments" 1 "different arguments" -- \
    -np 2 ./diffargs.sh "$B" quantize "$M" "${CAL[@]}" --hessian gptq --json --out bad
refused "more ranks than micro-batches" 2 "micro-batches" -- \
    -np 3 ./wrap.sh "$B" quantize "$M" --calib "$M/calib.safetensors" --samples 2 --batch 1 \
    --backend cpu --hessian gptq --json --out bad
refused "--layers with layer-parallel ranks" 2 "layers" -- \
    -np 2 ./wrap.sh "$B" quantize "$M" --activations acts --backend cpu --hessian gptq \
    --layers 0:2 --json --out bad
# a backprop kind with ranks and the GPU input side (bwd_input=gpu) is a job
# like any other (tests/test_cuda_mpi.sh runs it on a GPU); here, in a build
# without CUDA, asking for the CUDA backend ends it like one process does
if "$B" --version | grep -q "CUDA backend: not compiled"; then
    refused "a backprop kind with ranks, --backend cuda, a build without CUDA" 3 \
        "no CUDA backend" -- \
        -np 2 ./wrap.sh "$B" quantize "$M" --calib "$M/calib.safetensors" --samples 8 --batch 2 \
        --backend cuda --setting bwd_input=gpu --hessian backprop-kfac --json --out bad
fi
refused "--resume with ranks" 2 "--resume with several MPI ranks" -- \
    -np 2 ./wrap.sh "$B" quantize "$M" "${CAL[@]}" --hessian backprop-shampoo --resume --json \
    --out bad
# a rank that fails alone: its own bad input (a relative --calib that is
# truncated in rank 1's folder only)
mkdir r1
cp "$M/calib.safetensors" c.safetensors
head -c 100 "$M/calib.safetensors" >r1/c.safetensors
cat >onebad.sh <<EOF
#!/usr/bin/env bash
r=\${OMPI_COMM_WORLD_RANK:-0}
[ "\$r" = 1 ] && cd r1
exec "\$@" 2>"$W/err.\$r"
EOF
chmod +x onebad.sh
refused "one rank's bad input" 2 "rank 1: " -- \
    -np 2 ./onebad.sh "$B" quantize "$M" --calib c.safetensors --samples 8 --batch 2 \
    --backend cpu --hessian gptq --json --out bad
ls r1 | grep -q bad && die "rank 1 wrote an output"
# a rank killed in the middle: the launcher stops the job (128 sequences: the
# job must outlast the 3 s before the kill, also on an idle machine)
cat >killone.sh <<'EOF'
#!/usr/bin/env bash
r=${OMPI_COMM_WORLD_RANK:-0}
[ "$r" = 1 ] || exec "$@" 2>"err.$r"
"$@" 2>"err.$r" &
p=$!
sleep 3
kill -9 $p
wait $p
EOF
chmod +x killone.sh
# (the launcher sends SIGTERM, then SIGKILL after odls_base_sigkill_timeout s:
# given the time, rank 0 prints its line and removes its work folder)
refused "a rank killed" any "stopped by a signal" -- \
    -np 2 --mca odls_base_sigkill_timeout 20 ./killone.sh "$B" quantize "$M" \
    --calib "$M/calib.safetensors" --samples 128 --batch 2 --backend cpu \
    --hessian fullylocal-shampoo --json --out bad
# with Open MPI's default (SIGKILL 1 s after SIGTERM) rank 0 may die before it can
# print: no output folder all the same, and the next run clears the leftovers
rm -f err.*
"${MPIRUN[@]}" -np 2 ./killone.sh "$B" quantize "$M" --calib "$M/calib.safetensors" \
    --samples 128 --batch 2 --backend cpu --hessian fullylocal-shampoo --json --out bad \
    >/dev/null 2>mpirun.err; rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] || die "a rank killed (default launcher): exit $rc"
[ -e bad ] && die "a rank killed (default launcher): the output folder appeared"
"$B" quantize "$M" --hessian rtn --out bad 2>next.err || die "the next run: $(cat next.err)"
ls -a | grep -E '^(bad\.tmp|\.bad\.lock)' && die "the next run left the killed run's leftovers"
echo "ok: a rank killed, default launcher (exit $rc; next run: $(grep -c -i -E 'removed|cleared|stale' next.err) notes)"
rm -rf bad
# a rank that hangs (stopped): the others give up after --dist-timeout
cat >stopone.sh <<'EOF'
#!/usr/bin/env bash
r=${OMPI_COMM_WORLD_RANK:-0}
[ "$r" = 1 ] || exec "$@" 2>"err.$r"
"$@" 2>"err.$r" &
p=$!
sleep 3
kill -STOP $p
wait $p
EOF
chmod +x stopone.sh
refused "a rank that hangs" 3 "no answer" -- \
    -np 2 ./stopone.sh "$B" quantize "$M" --calib "$M/calib.safetensors" --samples 128 \
    --batch 2 --backend cpu --hessian fullylocal-shampoo --dist-timeout 5 --json --out bad
exit $fail
