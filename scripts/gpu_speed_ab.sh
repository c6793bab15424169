#!/usr/bin/env bash
# Before/after check of a GPU speed change (issue 20) on a GPU host, with the
# current CLI (BK_BAKRON, default build-gpu/bakron, e.g. built by
# scripts/gpu_run.sh) and the CLI of an older commit (built here in a git
# worktree under /tmp/ab-old, or taken from BK_OLD_BAKRON):
#
#   scripts/gpu_speed_ab.sh OLD_COMMIT OUTDIR
#
#  1. the example model through the GPU stages (--gpu-pipeline, 32 sequences,
#     ℓ = 3) for gptq, mlplocal-kfac and fullylocal-kfac, with the old CLI and
#     twice with the current one: the output model files must be byte-identical
#     (SHA-256); the largest relative difference of report.json's per-module
#     `loss` and `loss_gptq` is printed;
#  2. the Llama-3-8B shape (scripts/make_synthetic_llama.py, /tmp/syn-8b, made
#     unless it exists), layers AB_LAYERS (default 0:8), --hessian AB_HESSIAN
#     (default gptq), BK_PROFILE=1,
#     old then new: the codes (identical fraction), the per-module losses
#     (relative differences), the total and the profile timers side by side.
# Writes OUTDIR/ab.txt (the summary) and the logs. Exit status non-zero when an
# output differs or a run fails.
set -uo pipefail
OLD=${1:?usage: scripts/gpu_speed_ab.sh OLD_COMMIT OUTDIR}
OUT=${2:?usage: scripts/gpu_speed_ab.sh OLD_COMMIT OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
NEW=${BK_BAKRON:-build-gpu/bakron}
if [ ! -x "$NEW" ]; then
    echo "gpu_speed_ab: $NEW: no executable CLI (set BK_BAKRON or build build-gpu first)" >&2
    exit 1
fi
NEW=$(realpath "$NEW")
SUM=$OUT/ab.txt
: >"$SUM"
note() { echo "$*" | tee -a "$SUM"; }
status=0

OB=${BK_OLD_BAKRON:-/tmp/ab-old/b/bakron}
if [ -n "${BK_OLD_BAKRON:-}" ] && [ ! -x "$OB" ]; then
    echo "gpu_speed_ab: BK_OLD_BAKRON=$OB: no executable CLI" >&2
    exit 1
fi
if [ ! -x "$OB" ]; then
    t0=$(date +%s)
    rm -rf /tmp/ab-old
    git worktree prune 2>/dev/null
    if ! git worktree add --detach /tmp/ab-old "$OLD" >"$OUT/old-build.log" 2>&1; then
        mkdir -p /tmp/ab-old && git archive "$OLD" | tar -x -C /tmp/ab-old
    fi
    if ! (cd /tmp/ab-old && meson setup b -Dcuda=enabled -Dbuildtype=release &&
        ninja -C b -j "$(nproc)" bakron) >>"$OUT/old-build.log" 2>&1; then
        note "old build ($OLD): FAILED (old-build.log)"
        exit 1
    fi
    note "old build ($OLD): $(( $(date +%s) - t0 )) s"
fi

# 1. byte-identical outputs on the example
M=examples/kerneldocs-1.6m
Q=/tmp/ab-q
rm -rf "$Q"
mkdir -p "$Q"
for v in old new new2; do
    bk=$NEW
    [ "$v" = old ] && bk=$OB
    for h in gptq mlplocal-kfac fullylocal-kfac; do
        o=$Q/$v-$h
        if ! "$bk" quantize "$M" --calib "$M/calib.safetensors" --samples 32 --hessian "$h" \
            --levels 3 --backend cuda --gpu-pipeline --out "$o" >"$OUT/q-$v-$h.log" 2>&1; then
            note "example $v $h: FAILED ($(tail -1 "$OUT/q-$v-$h.log"))"
            status=1
            continue
        fi
        (cd "$o" && sha256sum ./*.safetensors) >"$Q/hash-$v-$h.txt"
        cp "$o/report.json" "$OUT/report-$v-$h.json"
    done
done
python3 - "$Q" "$OUT" <<'EOF' | tee -a "$SUM"
import json, sys
q, out = sys.argv[1], sys.argv[2]
bad = 0
for h in ("gptq", "mlplocal-kfac", "fullylocal-kfac"):
    try:
        hs = {v: open(f"{q}/hash-{v}-{h}.txt").read() for v in ("old", "new", "new2")}
        rs = {v: json.load(open(f"{out}/report-{v}-{h}.json")) for v in ("old", "new")}
    except OSError as e:
        print(f"example {h}: missing output ({e})")
        bad = 1
        continue
    same = hs["old"] == hs["new"]
    rep = hs["new"] == hs["new2"]
    bad |= not same
    d = {"loss": 0.0, "loss_gptq": 0.0}
    for a, b in zip(rs["old"]["modules"], rs["new"]["modules"]):
        for k in d:
            x, y = a.get(k), b.get(k)
            if x is None or y is None:
                continue
            if x != y:
                d[k] = max(d[k], abs(x - y) / max(abs(x), abs(y)))
    print(f"example {h}: model files old vs new {'IDENTICAL' if same else 'DIFFER'}, "
          f"new vs new again {'identical' if rep else 'differ'}; max rel. diff old/new: "
          f"loss {d['loss']:.3g}, loss_gptq {d['loss_gptq']:.3g}")
sys.exit(bad)
EOF
[ "${PIPESTATUS[0]}" = 0 ] || status=1
rm -rf "$Q"

# 2. the 8B shape, profile timers
DIR=/tmp/syn-8b
if [ ! -f "$DIR/config.json" ] || [ ! -f "$DIR/calib.safetensors" ]; then
    t0=$(date +%s)
    python3 scripts/make_synthetic_llama.py "$DIR" --shape 8b --generator torch \
        --calib-seqs 256 --calib-len 2048 >"$OUT/syn.log" 2>&1
    note "synthetic 8b checkpoint: $(( $(date +%s) - t0 )) s"
fi
for v in old new; do
    bk=$NEW
    [ "$v" = old ] && bk=$OB
    o=/tmp/ab-8b-$v
    rm -rf "$o"
    t0=$(date +%s.%N)
    BK_PROFILE=1 timeout "${AB_TIMEOUT:-240}" "$bk" quantize "$DIR" --calib "$DIR/calib.safetensors" \
        --hessian "${AB_HESSIAN:-gptq}" --levels 3 --backend cuda --gpu-pipeline --layers "${AB_LAYERS:-0:8}" \
        --out "$o" >"$OUT/8b-$v.log" 2>&1 || { note "8b $v: FAILED ($(tail -1 "$OUT/8b-$v.log"))"; status=1; }
    note "8b $v layers ${AB_LAYERS:-0:8} ${AB_HESSIAN:-gptq}: wall $(python3 -c "import time; print('%.1f' % (time.time() - $t0))") s"
    [ -f "$o/report.json" ] && cp "$o/report.json" "$OUT/report-8b-$v.json"
done
# codes (native export: I8 qweight per quantized module) and proxy losses, old vs new
python3 - /tmp/ab-8b-old /tmp/ab-8b-new <<'EOF2' | tee -a "$SUM"
import glob, json, os, struct, sys
import numpy as np
def index(d):
    out = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(n))
        for k, v in h.items():
            if k.endswith(".qweight") and v["dtype"] in ("I8", "U8"):
                out[k] = (f, 8 + n + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
    return out
def read(e):
    with open(e[0], "rb") as fh:
        fh.seek(e[1])
        return np.frombuffer(fh.read(e[2]), dtype=np.int8)
try:
    a, b = index(sys.argv[1]), index(sys.argv[2])
    same = total = 0
    for k in sorted(set(a) & set(b)):
        x, y = read(a[k]), read(b[k])
        same += int((x == y).sum())
        total += x.size
    if total:
        print(f"8b codes old vs new: {same}/{total} identical ({100.0 * same / total:.4f}%) over {len(set(a) & set(b))} modules")
    ra = json.load(open(os.path.join(sys.argv[1], "report.json")))["modules"]
    rb = json.load(open(os.path.join(sys.argv[2], "report.json")))["modules"]
    for key in ("loss", "loss_gptq"):
        d = [abs(p[key] - q[key]) / max(abs(p[key]), abs(q[key]), 1e-300) for p, q in zip(ra, rb)
             if p.get(key) is not None and q.get(key) is not None]
        sa = sum(p[key] for p in ra if p.get(key) is not None)
        sb = sum(q[key] for q in rb if q.get(key) is not None)
        if d:
            print(f"8b {key}: max rel. diff {max(d):.3g}, mean {sum(d) / len(d):.3g}; sum old {sa:.6g} new {sb:.6g}")
except Exception as e:
    print(f"8b codes/losses comparison failed: {e}")
EOF2
rm -rf /tmp/ab-8b-old /tmp/ab-8b-new
python3 - "$OUT/8b-old.log" "$OUT/8b-new.log" <<'EOF' | tee -a "$SUM"
import sys
def prof(p):
    d = {}
    for l in open(p, errors="replace"):
        f = l.split()
        if len(f) >= 4 and f[0] == "profile" and f[1] != "(BK_PROFILE):":
            d[" ".join(f[1:-2])] = float(f[-2])
    return d
a, b = prof(sys.argv[1]), prof(sys.argv[2])
print("%-40s %10s %10s" % ("timer (s, summed)", "old", "new"))
for k in sorted(set(a) | set(b), key=lambda k: -max(a.get(k, 0), b.get(k, 0))):
    print("%-40s %10s %10s" % (k, "%.3f" % a[k] if k in a else "-", "%.3f" % b[k] if k in b else "-"))
EOF
note "gpu_speed_ab: $([ $status = 0 ] && echo ok || echo FAILED)"
exit $status
