#!/usr/bin/env bash
# Paths on progress, banner and status lines are escaped as in the error
# lines (bk_escape_message: control characters and invalid UTF-8 as \x1b, \n,
# \xff): a model folder, --out, a calibration or weight file named with an
# ESC byte and a newline never reaches stdout or stderr raw (quantize and its
# --dry-run, dump-activations, merge, eval, solve). With --json every line is
# valid JSON made by cJSON: the path comes back as the same bytes when
# decoded (escaped once, by the JSON library).
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
cd "$W" || exit 1
export OPENBLAS_NUM_THREADS=1

# an ESC sequence and a newline in every name; NLMARK follows the newline
odd=$'\x1b[31mR\nNLMARK'
mkdir -p "d$odd"
cp -r "$M" "d$odd/m$odd"
MO="d$odd/m$odd"

# check LABEL FILE...: no control byte but LF and TAB; NLMARK always after a
# literal "\n" (the escaped newline), and at least once (unless NEED=0)
check() {
    local label=$1; shift
    NEED=${NEED:-1} python3 - "$label" "$@" <<'PY' || fail=1
import os, sys
label, files = sys.argv[1], sys.argv[2:]
data = b"".join(open(f, "rb").read() for f in files)
bad = sorted({b for b in data if b < 0x20 and b not in (0x0a, 0x09)})
ok = True
if bad:
    print(f"FAIL: {label}: raw control bytes {['%#04x' % b for b in bad]} in the output")
    ok = False
n = data.count(b"NLMARK")
if n == 0 and os.environ["NEED"] == "1":
    print(f"FAIL: {label}: the path is not in the output")
    ok = False
for i in range(len(data)):
    if data.startswith(b"NLMARK", i) and data[i - 2:i] != b"\\n":
        print(f"FAIL: {label}: a raw newline in a printed path: {data[max(0, i - 40):i + 6]!r}")
        ok = False
        break
if ok:
    print(f"ok: {label} ({n} escaped paths)")
sys.exit(0 if ok else 1)
PY
}
# json_check LABEL FILE KEY: every line of FILE is JSON; some event's KEY is the
# odd path (decoded: the raw bytes, not an escaped text)
json_check() {
    python3 - "$@" <<'PY' || fail=1
import json, sys
label, path, key, want = sys.argv[1:5]
ok, found = True, False
for line in open(path, "rb").read().decode("utf-8").splitlines():
    try:
        e = json.loads(line)
    except ValueError as x:
        print(f"FAIL: {label}: not a JSON line ({x}): {line[:120]!r}")
        ok = False
        continue
    if e.get(key) == want:
        found = True
if not found:
    print(f"FAIL: {label}: no event with {key} = the path ({want!r})")
    ok = False
elif ok:
    print(f"ok: {label} (JSON, {key} decodes to the path)")
sys.exit(0 if ok else 1)
PY
}

run() { # LABEL COMMAND...: stdout in out, stderr in err, exit 0 expected
    local label=$1; shift
    "$@" >out 2>err || { die "$label: exit $?: $(tail -2 err | cat -v)"; return 1; }
}

run "quantize" "$B" quantize "$MO" --hessian rtn --layers 0:2 --out "p1$odd" &&
    check "quantize: progress and banner" out err
run "quantize --json" "$B" quantize "$MO" --hessian rtn --layers 2:4 --json --out "p2$odd" &&
    json_check "quantize --json" out message "p2$odd" && NEED=0 check "quantize --json: stderr" err
run "quantize --dry-run" "$B" quantize "$MO" --calib "$M/calib.safetensors" --samples 2 \
    --dry-run --out "q$odd" && check "quantize --dry-run" out err
run "dump-activations" "$B" dump-activations "$MO" --calib "$M/calib.safetensors" --samples 2 \
    --backend cpu --out "a$odd" && check "dump-activations" out err
run "merge" "$B" merge "p1$odd" "p2$odd" --out "mg$odd" && check "merge" out err
run "merge --json" "$B" merge "p1$odd" "p2$odd" --json --out "mj$odd" &&
    json_check "merge --json" out out "mj$odd" && NEED=0 check "merge --json: stderr" err
run "eval" "$B" eval "mg$odd" --tokens "$M/eval.safetensors" --samples 2 --backend cpu &&
    check "eval" out err
# solve: W [4, 8] F32 and A [8, 8] F64 (I + 0.1) in a file with the odd name
python3 - "w$odd.safetensors" <<'PY' || die "solve input"
import json, struct, sys
w = [((i * 7 + 3) % 11 - 5) / 5.0 for i in range(32)]
a = [(1.1 if i == j else 0.1) for i in range(8) for j in range(8)]
wb, ab = struct.pack("<32f", *w), struct.pack("<64d", *a)
h = json.dumps({"W": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, len(wb)]},
                "A": {"dtype": "F64", "shape": [8, 8], "data_offsets": [len(wb), len(wb) + len(ab)]}}).encode()
h += b" " * (-len(h) % 8)
open(sys.argv[1], "wb").write(struct.pack("<Q", len(h)) + h + wb + ab)
PY
run "solve" "$B" solve --weight "w$odd.safetensors:W" --hessian-a "w$odd.safetensors:A" \
    --backend cpu --out "s$odd.safetensors" && check "solve" out err
[ $fail -eq 0 ] && echo "all progress escape checks passed"
exit $fail
