# shellcheck shell=bash disable=SC2034 # (its variables are read by the sourcing test)
# Sourced by the bash tests (tests/*.sh), after `set -u`:
#   B    the bakron binary (BK_BAKRON, from meson)
#   SRC  the source root (BK_SOURCE_ROOT)
#   M    the bundled example model
#   W    a work folder, removed at exit
#   die  records a failure (the test ends with `exit $fail`)
# and helpers of the GPU tests (suite cuda).
B=${BK_BAKRON:?}
SRC=${BK_SOURCE_ROOT:?}
M=$SRC/examples/kerneldocs-1.6m
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
fail=0
die() { echo "FAIL: $*"; fail=1; }

# cuda_skip RC ERRFILE: a probe with --backend cuda exited with RC and wrote
# its stderr to ERRFILE; without a usable CUDA device the test is skipped
# (exit 77).
cuda_skip() {
    if [ "$1" = 3 ] && grep -qE "no usable CUDA device|no CUDA backend" "$2"; then
        echo "no CUDA device: skipped"
        exit 77
    fi
}

# The eval tokens of M the GPU tests use, and their probe: eval --backend cuda
# (output in $W/probe.json); skipped without a device, failed on an error.
EV="--tokens $M/eval.safetensors --samples 32"
cuda_probe_eval() {
    "$B" eval "$M" $EV --backend cuda --json >"$W/probe.json" 2>"$W/probe.err"
    local rc=$?
    cuda_skip $rc "$W/probe.err"
    [ $rc = 0 ] || { echo "FAIL: eval --backend cuda: $(cat "$W/probe.err")"; exit 1; }
}

# ppl FOLDER [BACKEND]: the perplexity of FOLDER on EV (backend cpu by default)
ppl() {
    "$B" eval "$1" $EV --backend "${2:-cpu}" --json 2>"$W/eval.err" |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["perplexity"])'
}

# close A B TOL LABEL: |A - B| <= TOL |B| (both finite), printed
close() {
    python3 - "$@" <<'PY'
import math, sys
a, b, tol, label = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
ok = math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tol * abs(b)
print(f"{label}: {a:.7f} vs {b:.7f} (rel {abs(a - b) / abs(b):.2e}, tol {tol:g}): {'ok' if ok else 'MISMATCH'}")
sys.exit(0 if ok else 1)
PY
}

# codes DIR_A DIR_B LABEL [fp64|exact|info]: identical codes of two native
# outputs, module by module (tests/codes_agree.py has the rules)
codes() {
    PYTHONPATH="$SRC/tests" python3 "$SRC/tests/codes_agree.py" "$@"
}
