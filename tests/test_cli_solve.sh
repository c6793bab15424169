#!/usr/bin/env bash
# CLI test for `bakron solve` and `bakron bench` (run by meson as 'cli_solve').
#
# The inputs are written here by a small Python (standard library only)
# safetensors writer: a random W [6, 10] (F32), SPD factors A [10, 10] (F64)
# and B [6, 6] (BF16), and malformed variants.
# 1. Good runs exit 0; the output file is read back independently (Python):
#    tensor names, dtypes, shapes, code ranges, weight = (codes - zero) * scale,
#    metadata; --json is one JSON document; naive and bakron agree in fp64.
# 2. Bad input exits 2 with exactly one line on stderr naming the tensor.
# 3. Usage errors exit 1.
# 4. bench --json on tiny shapes: exit 0, every algorithm agrees with bakron.
set -u

: "${BK_BAKRON:?BK_BAKRON must point to the bakron executable}"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/bk_cli_solve.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
failures=0
checks=0

fail() {
    echo "FAIL: $*" >&2
    failures=$((failures + 1))
}

run() {
    "$BK_BAKRON" "$@" >"$tmp/out" 2>"$tmp/err"
    rc=$?
    checks=$((checks + 1))
}

expect_ok() { # label
    if [ "$rc" -ne 0 ]; then
        fail "$1: exit $rc, expected 0; stderr:"
        sed 's/^/    | /' "$tmp/err" >&2
    fi
}

expect_err() { # label code [stderr regex]
    if [ "$rc" -ne "$2" ]; then
        fail "$1: exit $rc, expected $2; stderr:"
        sed 's/^/    | /' "$tmp/err" >&2
        return
    fi
    if [ "$2" -eq 2 ] || [ "$2" -eq 3 ]; then
        lines=$(wc -l <"$tmp/err")
        [ "$lines" -eq 1 ] || fail "$1: expected exactly one line on stderr, got $lines"
        [ -s "$tmp/out" ] && fail "$1: expected nothing on stdout"
    fi
    if [ $# -ge 3 ] && ! grep -Eq -- "$3" "$tmp/err"; then
        fail "$1: stderr does not match '$3':"
        sed 's/^/    | /' "$tmp/err" >&2
    fi
}

# ------------------------------------------------------------ the inputs
python3 - "$tmp" <<'EOF' || { echo "FAIL: cannot write the inputs" >&2; exit 1; }
import json, math, random, struct, sys
d = sys.argv[1]
random.seed(7)

def write(path, tensors, raw_tail=b""):
    """tensors: list of (name, dtype, shape, packed bytes)."""
    header, off, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, dt, shape, data in tensors:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs) + raw_tail)

def f32(v): return struct.pack("<%df" % len(v), *v)
def f64(v): return struct.pack("<%dd" % len(v), *v)
def bf16(v): return b"".join(struct.pack("<f", x)[2:] for x in v)  # truncation, exact for our values
def i32(v): return struct.pack("<%di" % len(v), *v)

def spd(n, k):
    X = [[random.gauss(0, 1) for _ in range(k)] for _ in range(n)]
    return [sum(X[i][t] * X[j][t] for t in range(k)) / k + (0.1 if i == j else 0.0)
            for i in range(n) for j in range(n)]

m, n = 6, 10
W = [random.gauss(0, 0.1) for _ in range(m * n)]
A = spd(n, 14)
# B: values exactly representable in BF16 (multiples of 1/8, symmetric, diagonally dominant)
B = [(4.0 if i == j else (0.125 * ((i + j) % 3 - 1))) for i in range(m) for j in range(m)]
write(f"{d}/good.safetensors", [("w", "F32", [m, n], f32(W)), ("a", "F64", [n, n], f64(A)),
                                ("b", "BF16", [m, m], bf16(B))])
A9 = spd(9, 12)
write(f"{d}/bad.safetensors", [
    ("a9", "F64", [9, 9], f64(A9)),
    ("b5", "F32", [5, 5], f32(B[:25])),
    ("w3d", "F32", [2, 3, 10], f32(W)),
    ("wint", "I32", [m, n], i32(list(range(m * n)))),
    ("wnan", "F32", [m, n], f32([float("nan") if t == 13 else W[t] for t in range(m * n)])),
    ("asym", "F64", [n, n], f64([A[t] + (1.0 if t == 3 else 0.0) for t in range(n * n)])),
    ("aneg", "F64", [n, n], f64([-A[t] if t == 0 else A[t] for t in range(n * n)])),
])
# a truncated file: header promises more bytes than there are
write(f"{d}/trunc.safetensors", [("w", "F32", [m, n], f32(W))])
with open(f"{d}/trunc.safetensors", "r+b") as f:
    f.truncate(f.seek(0, 2) - 7)
EOF

G="$tmp/good.safetensors"
BAD="$tmp/bad.safetensors"

# read back an output file and check it (Python): ARGS out kind
check_out() {
    python3 - "$@" <<'EOF'
import json, struct, sys
path, kind = sys.argv[1], sys.argv[2]
raw = open(path, "rb").read()
(hn,) = struct.unpack("<Q", raw[:8])
hdr = json.loads(raw[8:8 + hn])
base = 8 + hn
meta = hdr.pop("__metadata__")
def get(name):
    e = hdr[name]
    b, t = e["data_offsets"]
    data = raw[base + b: base + t]
    fmt = {"I8": "b", "U8": "B", "F32": "f"}[e["dtype"]]
    return e["dtype"], e["shape"], struct.unpack("<%d%s" % (len(data) // struct.calcsize(fmt), fmt), data)
def f32(x): return struct.unpack("<f", struct.pack("<f", x))[0]
dt, shp, codes = get("codes")
_, sshp, scales = get("scales")
_, wshp, weight = get("weight")
m, n = shp
g = sshp[1]
errs = []
if kind == "levels":
    if dt != "I8": errs.append("codes dtype %s, expected I8" % dt)
    if "zeros" in hdr: errs.append("unexpected zeros tensor")
    if g != 1: errs.append("groups %d, expected 1" % g)
    if any(abs(c) > 3 for c in codes): errs.append("code outside -3..3")
    for t in range(m * n):
        if weight[t] != f32(codes[t] * scales[t // n]):
            errs.append("weight[%d] != code * scale" % t); break
else:  # uniform 4 bits, group 4, asym
    if dt != "U8": errs.append("codes dtype %s, expected U8" % dt)
    _, zshp, zeros = get("zeros")
    if sshp != [m, 3] or zshp != [m, 3]: errs.append("scales/zeros shape %s %s" % (sshp, zshp))
    if any(c > 15 for c in codes): errs.append("code outside 0..15")
    for t in range(m * n):
        i, j = divmod(t, n)
        s, z = scales[i * g + j // 4], zeros[i * g + j // 4]
        if weight[t] != f32(s * (codes[t] - z)):
            errs.append("weight[%d] != (code - zero) * scale" % t); break
if wshp != [m, n]: errs.append("weight shape %s" % wshp)
for k in ("algorithm", "damp_a", "damp_b", "loss_two_sided", "loss_one_sided", "bound",
          "time_solve_s", "quantizer"):
    if k not in meta: errs.append("metadata %s missing" % k)
if float(meta.get("loss_two_sided", "nan")) <= 0: errs.append("loss_two_sided not positive")
if errs:
    print("; ".join(errs)); sys.exit(1)
EOF
}

same_codes() { # out1 out2
    python3 - "$1" "$2" <<'EOF'
import json, struct, sys
def codes(p):
    raw = open(p, "rb").read(); (hn,) = struct.unpack("<Q", raw[:8]); h = json.loads(raw[8:8 + hn])
    b, t = h["codes"]["data_offsets"]; return raw[8 + hn + b: 8 + hn + t]
a, b = codes(sys.argv[1]), codes(sys.argv[2])
sys.exit(0 if a == b and len(a) > 0 else 1)
EOF
}

# ------------------------------------------------------------ good runs
run solve --weight "$G:w" --hessian-a "$G:a" --hessian-b "$G:b" --out "$tmp/o1.safetensors" --backend cpu
expect_ok "levels default"
msg=$(check_out "$tmp/o1.safetensors" levels) || fail "levels output: $msg"
grep -q "loss two-sided" "$tmp/out" || fail "levels default: no summary on stdout"

run solve --weight "$G:w" --hessian-a "$G:a" --hessian-b "$G:b" --out "$tmp/o2.safetensors" \
    --bits 4 --group 4 --asym --precision fp64 --json --backend cpu
expect_ok "uniform g4 asym fp64 json"
msg=$(check_out "$tmp/o2.safetensors" uniform) || fail "uniform output: $msg"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["groups"]==3 and d["algorithm"]=="bakron" and d["bound"] is not None and d["loss_two_sided"]>0' \
    "$tmp/out" || fail "uniform --json: bad or missing fields"

for alg in naive antidiag recursive; do
    run solve --weight "$G:w" --hessian-a "$G:a" --hessian-b "$G:b" --out "$tmp/o_$alg.safetensors" \
        --algorithm "$alg" --precision fp64 --backend cpu
    expect_ok "$alg fp64"
done
run solve --weight "$G:w" --hessian-a "$G:a" --hessian-b "$G:b" --out "$tmp/o_bakron.safetensors" \
    --precision fp64 --backend cpu
expect_ok "bakron fp64"
for alg in naive antidiag recursive; do
    same_codes "$tmp/o_$alg.safetensors" "$tmp/o_bakron.safetensors" || fail "$alg and bakron codes differ (fp64)"
done

run solve --weight "$G:w" --hessian-a "$G:a" --out "$tmp/o3.safetensors" --algorithm gptq \
    --bits 4 --group 4 --refit-groups --no-mse --backend cpu
expect_ok "gptq refit, no B"
run solve --weight "$G:w" --hessian-a "$G:a" --out "$tmp/o4.safetensors" --bits 8 --damp 0.01 --backend cpu
expect_ok "8 bits, damp 0.01, no B"
run solve --weight "$G:w" --hessian-a "$G:a" --out "$tmp/o5.safetensors" --algorithm rtn --levels 1 --backend cpu
expect_ok "rtn levels 1"

# ------------------------------------------------------------ bad input: exit 2
run solve --weight "$G:w" --hessian-a "$BAD:a9" --out "$tmp/x.safetensors" --backend cpu
expect_err "A wrong shape" 2 "a9"
run solve --weight "$G:w" --hessian-a "$G:a" --hessian-b "$BAD:b5" --out "$tmp/x.safetensors" --backend cpu
expect_err "B wrong shape" 2 "b5"
run solve --weight "$BAD:w3d" --hessian-a "$G:a" --out "$tmp/x.safetensors" --backend cpu
expect_err "W 3-D" 2 "w3d"
run solve --weight "$BAD:wint" --hessian-a "$G:a" --out "$tmp/x.safetensors" --backend cpu
expect_err "W integer dtype" 2 "wint.*I32"
run solve --weight "$BAD:wnan" --hessian-a "$G:a" --out "$tmp/x.safetensors" --backend cpu
expect_err "W NaN" 2 "wnan.*\[1, 3\]"
run solve --weight "$G:w" --hessian-a "$BAD:asym" --out "$tmp/x.safetensors" --backend cpu
expect_err "A not symmetric" 2 "asym.*symmetric"
run solve --weight "$G:w" --hessian-a "$BAD:aneg" --out "$tmp/x.safetensors" --backend cpu
expect_err "A negative diagonal" 2 "aneg"
run solve --weight "$G:missing" --hessian-a "$G:a" --out "$tmp/x.safetensors" --backend cpu
expect_err "missing tensor" 2 "missing"
run solve --weight "$tmp/trunc.safetensors:w" --hessian-a "$G:a" --out "$tmp/x.safetensors" --backend cpu
expect_err "truncated file" 2 "trunc"
run solve --weight "$tmp/nothere.safetensors:w" --hessian-a "$G:a" --out "$tmp/x.safetensors" --backend cpu
expect_err "no such file" 2 "nothere"
[ -e "$tmp/x.safetensors" ] && fail "an output was written for bad input"

# ------------------------------------------------------------ usage: exit 1
run solve --weight "$G:w" --hessian-a "$G:a"
expect_err "no --out" 1
run solve --weight "$G:w" --hessian-a "$G:a" --out "$tmp/x.safetensors" --bits 5
expect_err "--bits 5" 1
run solve --weight "$G:w" --hessian-a "$G:a" --out "$tmp/x.safetensors" --bits 4 --levels 3
expect_err "--bits and --levels" 1
run solve --weight "$G:w" --hessian-a "$G:a" --out "$tmp/x.safetensors" --group 8
expect_err "--group without --bits" 1
run solve --weight "$G:w" --hessian-a "$G:a" --out "$tmp/x.safetensors" --algorithm fast
expect_err "unknown algorithm" 1
run solve --weight "$G:w" --hessian-a "$G:a" --out "$tmp/x.safetensors" --backend gpu
expect_err "unknown backend" 1
run solve --weight "$G:w" --hessian-a "$G:a" --out "$tmp/x.safetensors" --bits 4 --group 4 --refit-groups
expect_err "--refit-groups without gptq" 1
run solve --weight "$G:w" --hessian-a "$G:a" --out "$tmp/x.safetensors" --frobnicate
expect_err "unknown option" 1
run solve --weight "$G" --hessian-a "$G:a" --out "$tmp/x.safetensors"
expect_err "no tensor name" 1
# --out an input file (also by another spelling): refused before the work, the input intact
G_sum=$(sha256sum <"$G")
run solve --weight "$G:w" --hessian-a "$G:a" --out "$G" --backend cpu
expect_err "--out is the input" 1 "is the input --weight"
run solve --weight "$G:w" --hessian-a "$G:a" --out "$(dirname "$G")/./$(basename "$G")" --backend cpu
expect_err "--out is the input (./)" 1 "is the input --weight"
[ "$(sha256sum <"$G")" = "$G_sum" ] || fail "--out the input file: the input was changed"
run solve --weight "$G:w" --hessian-a "$G:a" --out "$tmp" --backend cpu
expect_err "--out a folder" 1 "is a folder, not a regular file"
[ -e "$tmp/x.safetensors" ] && fail "an output was written for a usage error"
run solve --help
expect_ok "--help"

# ------------------------------------------------------------ bench
run bench --backend cpu --shapes 8x8,5x13,13x5 --repeat 1 --json
expect_ok "bench --json"
python3 - "$tmp/out" <<'EOF' || fail "bench --json: bad results"
import json, sys
d = json.load(open(sys.argv[1]))
rs = d["results"]
assert len(rs) == 15, len(rs)
for r in rs:
    assert not r["skipped"], r
    assert r["median_s"] >= 0 and r["gflops"] >= 0
    if r["algorithm"] in ("bakron", "naive", "antidiag", "recursive"):
        assert r["code_diff_vs_bakron"] == 0, r
EOF
run bench --backend cpu --shapes 4x4 --repeat 2 --algorithms bakron,rtn
expect_ok "bench table"
grep -q "rtn" "$tmp/out" || fail "bench table: no rtn row"
run bench --shapes 4y4
expect_err "bench bad shape" 1

echo "cli_solve: $checks runs, $failures failures"
[ "$failures" -eq 0 ]
