#!/bin/sh
# bakron quantize --hessian backprop-kfac / backprop-shampoo end to end on the
# example model (a subset of the calibration set), --backend cpu (the GPU flow:
# test_cuda_backprop.sh):
#  - recursive halving and naive I write the same bytes (the flows deliver the
#    same gradients; naive is the reference);
#  - a rerun with the same seed is identical, another seed is not;
#  - report.json records the flow's passes, depth and boundary memory (the
#    counts follow from the recursion over 4 layers);
#  - the progress events show every backward pass with its depth;
#  - progress within a pass (--progress-interval 0: every micro-batch but a
#    pass's last) with the pass count and an ETA from the flow's work: the
#    work share only grows, ends at 1, and every pass line of the schedule
#    (7 passes over 4 layers, leaf 1) is there; none at the default interval;
#  - a wider split (--bwd-boundaries 7: the root's 4 children, one per leaf)
#    and the automatic budget write the same bytes as halving, with the passes,
#    depth and boundary peak of the wider tree; (the other runs here take
#    --bwd-boundaries 0: recursive halving, whatever the host's memory);
#  - Shampoo, the empirical Fisher and a leaf of 2 layers run;
#  - bad input fails with one line.
set -eu
B=${BK_BAKRON:-build/bakron}
K=${BK_SOURCE_ROOT:-.}/examples/kerneldocs-1.6m
BAD=${BK_TEST_DATA:-tests/data}/bad/models
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
# (--bwd-boundaries 0 unless the call gives its own: an option is given once)
q() {
    case " $* " in
    *" --bwd-boundaries "*) set -- "$@" ;;
    *) set -- --bwd-boundaries 0 "$@" ;;
    esac
    "$B" quantize "$K" --calib "$K/calib.safetensors" --samples 4 --seqlen 64 --batch 3 --backend cpu "$@"
}

q --hessian backprop-kfac --out "$T/h" --json >"$T/h.json"
q --hessian backprop-kfac --bwd-flow naive --out "$T/n" 2>/dev/null
q --hessian backprop-kfac --out "$T/h2" 2>/dev/null
q --hessian backprop-kfac --seed 1 --out "$T/s1" 2>/dev/null
cmp -s "$T/h/model.safetensors" "$T/n/model.safetensors" ||
    fail "recursive halving and naive I wrote different weights"
cmp -s "$T/h/model.safetensors" "$T/h2/model.safetensors" || fail "a rerun differs"
cmp -s "$T/h/model.safetensors" "$T/s1/model.safetensors" && fail "--seed 1 changed nothing"
python3 - "$T" <<'EOF'
import json, sys
T = sys.argv[1]
h = json.load(open(f"{T}/h/report.json"))["backprop"]
n = json.load(open(f"{T}/n/report.json"))["backprop"]
# 4 layers, leaf 1: splits [0,4) [0,2) [2,4) + 4 leaves; naive: 4 sweeps
assert (h["flow"], h["passes"], h["max_depth"]) == ("halving", 7, 2), h
assert (h["device"], h["precision"]) == ("cpu", "fp64"), h  # --backend cpu: the CPU flow
assert (n["flow"], n["passes"], n["peak_boundary_host_bytes"]) == ("naive", 4, 0), n
# boundaries of 4 x 64 tokens x 192 doubles: at most X_mid, G_mid, G_L of the root and the two
# of a child alive at once
one = 4 * 64 * 192 * 8
assert h["peak_boundary_host_bytes"] == 5 * one, h
assert h["planned_peak_boundary_host_bytes"] == 5 * one and h["boundary_dtype"] == "f64", h
# naive: 4 + 3 + 2 + 1 layers back (+ recomputation), halving: fewer per layer
assert n["layer_backwards"] == 10 and h["layer_backwards"] == 8, (n, h)
ev = [json.loads(l) for l in open(f"{T}/h.json")]
bw = [e for e in ev if e["event"] == "backward"]
assert not any("unstable" in e.get("message", "") for e in ev), "kfac: no Shampoo warning"
assert len(bw) == 7, len(bw)
assert any("depth 2" in e["message"] for e in bw) and "depth 0" in bw[0]["message"], bw
mods = [e for e in ev if e["event"] == "module"]
assert len(mods) == 28 and all(m["damp_b"] > 0 for m in mods), "every module two-sided"
print("halving == naive, passes/depth/boundary bytes as expected, 7 backward events")
EOF
# --bwd-precision auto (the default since session 16): resolved once per job,
# before the work; the CPU's flow resolves it to fp32 (and runs in fp64 whatever
# the value): the default run h, --bwd-precision auto and --bwd-precision fp32
# write the same bytes; the start line, the plan (--dry-run, text and JSON) and
# report.json say which value was resolved and whether it came from auto
q --hessian backprop-kfac --bwd-precision auto --out "$T/au" 2>"$T/au.log" ||
    { cat "$T/au.log"; fail "--bwd-precision auto"; }
cmp -s "$T/h/model.safetensors" "$T/au/model.safetensors" ||
    fail "--bwd-precision auto (CPU) wrote other weights than the default (auto)"
grep -q "^bakron: .*; backward on the CPU, --bwd-precision fp32 (auto) (the CPU's flow: fp64)" \
    "$T/au.log" || { cat "$T/au.log"; fail "auto: the start line lacks the resolved precision"; }
q --hessian backprop-kfac --out "$T/df" 2>"$T/df.log" || { cat "$T/df.log"; fail "the default run"; }
grep -q "^bakron: .*; backward on the CPU, --bwd-precision fp32 (auto) (the CPU's flow: fp64)" \
    "$T/df.log" || { cat "$T/df.log"; fail "default: the start line lacks auto's resolved precision"; }
q --hessian backprop-kfac --bwd-precision fp32 --out "$T/f32" 2>"$T/f32.log" ||
    { cat "$T/f32.log"; fail "--bwd-precision fp32"; }
cmp -s "$T/h/model.safetensors" "$T/f32/model.safetensors" ||
    fail "--bwd-precision fp32 (CPU) wrote other weights than the default (auto: fp32 here)"
grep -q "^bakron: .*; backward on the CPU, --bwd-precision fp32 (the CPU's flow: fp64)" \
    "$T/f32.log" || { cat "$T/f32.log"; fail "fp32: the start line"; }
q --hessian backprop-kfac --bwd-precision bf16 --out "$T/x" --dry-run >"$T/pl.txt" ||
    fail "--dry-run --bwd-precision bf16"
grep -q "^  backward      on the CPU, --bwd-precision bf16 (the CPU's flow: fp64)$" "$T/pl.txt" ||
    { cat "$T/pl.txt"; fail "plan: bf16 as given"; }
q --hessian backprop-kfac --bwd-precision auto --out "$T/x" --dry-run >"$T/pl.txt" ||
    fail "--dry-run --bwd-precision auto"
grep -q "^  backward      on the CPU, --bwd-precision fp32 (auto) (the CPU's flow: fp64)$" \
    "$T/pl.txt" || { cat "$T/pl.txt"; fail "plan: auto not resolved to fp32"; }
q --hessian backprop-kfac --out "$T/x" --dry-run >"$T/pd.txt" || fail "--dry-run (default)"
grep -q "^  backward      on the CPU, --bwd-precision fp32 (auto) (the CPU's flow: fp64)$" \
    "$T/pd.txt" || { cat "$T/pd.txt"; fail "plan: the default (auto) not resolved to fp32"; }
q --hessian backprop-kfac --bwd-precision auto --out "$T/x" --dry-run --json >"$T/pl.json" ||
    fail "--dry-run --json --bwd-precision auto"
q --hessian backprop-kfac --out "$T/x" --dry-run --json >"$T/pd.json" ||
    fail "--dry-run --json (default)"
q --hessian backprop-kfac --bwd-precision fp32 --out "$T/x" --dry-run --json >"$T/p32.json" ||
    fail "--dry-run --json --bwd-precision fp32"
# a preset may ask for a precision; the command line overrides it
printf '{"hessian": "backprop-kfac", "bwd-precision": "auto"}\n' >"$T/preset.json"
q --config "$T/preset.json" --out "$T/x" --dry-run --json >"$T/pp.json" || fail "preset with auto"
q --config "$T/preset.json" --bwd-precision fp64 --out "$T/x" --dry-run --json >"$T/po.json" ||
    fail "preset with auto, --bwd-precision fp64"
printf '{"hessian": "backprop-kfac", "bwd-precision": "fp32"}\n' >"$T/preset32.json"
q --config "$T/preset32.json" --out "$T/x" --dry-run --json >"$T/pf.json" || fail "preset with fp32"
[ ! -e "$T/x" ] || fail "a dry run wrote $T/x"
python3 - "$T" <<'EOF3'
import json, sys
T = sys.argv[1]
rep = lambda d: json.load(open(f"{T}/{d}/report.json"))["backprop"]
# the CPU's flow: arithmetic fp64; the option as resolved (auto: fp32 on the CPU) and
# whether it came from auto (the default h and df, --bwd-precision auto) or was given
for d, want in (("h", ("fp64", "fp32", True)), ("df", ("fp64", "fp32", True)),
                ("au", ("fp64", "fp32", True)), ("f32", ("fp64", "fp32", False))):
    b = rep(d)
    assert (b["precision"], b["precision_option"], b["precision_auto"]) == want, (d, b)
    assert b["boundary_dtype"] == "f64", (d, b)
for name, want in (("pl", ("cpu", "fp32", True)), ("pd", ("cpu", "fp32", True)),
                   ("p32", ("cpu", "fp32", False)), ("pp", ("cpu", "fp32", True)),
                   ("po", ("cpu", "fp64", False)), ("pf", ("cpu", "fp32", False))):
    p = json.loads(open(f"{T}/{name}.json").readline())
    assert p["event"] == "plan", p
    assert (p["bwd_device"], p["bwd_precision"], p["bwd_precision_auto"]) == want, (name, p)
print("--bwd-precision auto (the default): fp32 on the CPU (start line, plan, preset, report.json)")
EOF3
# wider splits: the same bytes, fewer passes
q --hessian backprop-kfac --bwd-boundaries 7 --out "$T/w" --json >"$T/w.json"
q --hessian backprop-kfac --bwd-boundaries auto --out "$T/a" 2>/dev/null
q --hessian backprop-kfac --bwd-boundaries 6 --out "$T/w6" 2>/dev/null
for d in w a w6; do
    cmp -s "$T/h/model.safetensors" "$T/$d/model.safetensors" ||
        fail "--bwd-boundaries ($d) wrote other weights than recursive halving"
done
python3 - "$T" <<'EOF'
import json, sys
T = sys.argv[1]
one = 4 * 64 * 192 * 8
w = json.load(open(f"{T}/w/report.json"))["backprop"]
# 4 layers, leaf 1, 7 matrices: the root's sweep keeps X and G at layers 1, 2, 3 and the
# head's G_L (2 x 3 + 1), then 4 leaves; back through layers 1-3 once, then 1 per leaf
assert (w["passes"], w["max_depth"], w["root_children"], w["boundary_budget"]) == (5, 1, 4, 7), w
assert w["peak_boundary_host_bytes"] == 7 * one == w["planned_peak_boundary_host_bytes"], w
assert (w["layer_backwards"], w["layer_forwards"]) == (7, 11), w
bw = [e for e in map(json.loads, open(f"{T}/w.json")) if e["event"] == "backward"]
assert len(bw) == 5 and "depth 0" in bw[0]["message"] and not any("depth 2" in e["message"] for e in bw), bw
# 6 matrices do not hold 4 children (7) but 3, cut at layers 1 and 2: [0,1) [1,2) [2,4); during
# the first child 2 x 2 + 1 = 5 alive, during the last X_2 and G_L + its own halving's 2 = 4;
# passes: the root, 2 leaves, the split of [2,4) and its 2 leaves; back through 3 + 1 + 1 + 1 + 1 + 1
w6 = json.load(open(f"{T}/w6/report.json"))["backprop"]
assert (w6["passes"], w6["max_depth"], w6["root_children"]) == (6, 2, 3), w6
assert w6["peak_boundary_host_bytes"] == 5 * one and w6["layer_backwards"] == 8, w6
a = json.load(open(f"{T}/a/report.json"))["backprop"]
# auto: the host's memory (here ample) allows the widest split
assert a["boundary_budget"] >= 7 and a["root_children"] == 4 and a["passes"] == 5, a
print("--bwd-boundaries 7 / 6 / auto: same bytes; passes 5 / 6 / 5, peak 7 / 5 / 7 matrices")
EOF
# progress within the passes: text lines and JSON events
q --hessian backprop-kfac --progress-interval 0 --out "$T/p" 2>"$T/p.log" ||
    { cat "$T/p.log"; fail "--progress-interval 0"; }
for p in 1 2 3 4 5 6 7; do
    grep -q "^  backward pass $p of 7 (halving, depth [0-2]): .*  elapsed [0-9.]*s  ETA " "$T/p.log" ||
        { cat "$T/p.log"; fail "no line for backward pass $p of 7 with an ETA"; }
    # 4 sequences in micro-batches of 3: a line after the first
    grep -q "^  backward pass $p of 7: 3/4 sequences  elapsed [0-9.]*s  ETA [0-9.]*s$" "$T/p.log" ||
        { cat "$T/p.log"; fail "no progress line within backward pass $p"; }
done
grep -q "^layer 0 done (1/4)  elapsed [0-9.]*s  ETA [0-9.]*s  (" "$T/p.log" ||
    { cat "$T/p.log"; fail "layer 0 done: no ETA"; }
q --hessian backprop-kfac --out "$T/d" 2>"$T/d.log"
grep -q " sequences  elapsed" "$T/d.log" && { cat "$T/d.log"; fail "progress lines at the default interval"; }
q --hessian backprop-kfac --bwd-flow naive --progress-interval 0 --out "$T/pj" --json >"$T/pj.json"
python3 - "$T/pj.json" <<'EOF2'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
pr = [e for e in ev if e["event"] == "backward_progress"]
# naive over 4 layers, leaf 1: 4 passes, one event each (3 of 4 sequences)
assert [(e["pass"], e["passes"], e["pass_seqs_done"], e["pass_seqs"]) for e in pr] == \
    [(p, 4, 3, 4) for p in (1, 2, 3, 4)], pr
assert all(e["eta_s"] is not None and e["eta_s"] >= 0 for e in pr), pr
bp = [e for e in ev if "work_done" in e]
w = [e["work_done"] for e in bp]
assert all(b >= a - 1e-12 for a, b in zip(w, w[1:])), w
assert w[0] == 0 and 0 < max(w[:-1]) < 1 and abs(w[-1] - 1) < 1e-9, w
ld = [e for e in ev if e["event"] == "layer_done"]
assert len(ld) == 4 and ld[-1]["eta_s"] == 0 and all(e["eta_s"] is not None for e in ld), ld
print("progress within the passes: %d events, work share %.3f .. %.3f" % (len(pr), w[0], w[-1]))
EOF2

q --hessian backprop-shampoo --leaf-size 2 --fisher empirical --out "$T/e" 2>"$T/e.log" ||
    { cat "$T/e.log"; fail "backprop-shampoo --leaf-size 2 --fisher empirical"; }
# backprop-shampoo is unstable on SmolLM2 (docs/hessians.md): a warning line on stderr
grep -q '^bakron: warning: backprop-shampoo is unstable on some models' "$T/e.log" ||
    { cat "$T/e.log"; fail "backprop-shampoo: no warning on stderr"; }
python3 -c "
import json,sys; r=json.load(open('$T/e/report.json'))['backprop']
assert (r['fisher'], r['leaf_size'], r['passes']) == ('empirical', 2, 3), r"

# bad input: one line each
expect() { # expected-exit needle args...
    want=$1 needle=$2
    shift 2
    set +e
    "$@" >/dev/null 2>"$T/err"
    rc=$?
    set -e
    [ "$rc" -eq "$want" ] || { cat "$T/err"; fail "$*: exit $rc, expected $want"; }
    [ "$(wc -l <"$T/err")" -eq 1 ] || { cat "$T/err"; fail "$*: not one line"; }
    grep -q -- "$needle" "$T/err" || { cat "$T/err"; fail "$*: message lacks '$needle'"; }
}
expect 1 "--fisher" q --hessian backprop-kfac --fisher nope --out "$T/x"
expect 1 "--bwd-flow" q --hessian backprop-kfac --bwd-flow yaqa --out "$T/x"
expect 1 "--leaf-size" q --hessian backprop-kfac --leaf-size 0 --out "$T/x"
expect 1 "--bwd-precision: expected fp32, fp64, tf32, bf16 or auto, got 'fp16'" \
    q --hessian backprop-kfac --bwd-precision fp16 --out "$T/x"
expect 1 "--bwd-boundaries" q --hessian backprop-kfac --bwd-boundaries -1 --out "$T/x"
expect 1 "--bwd-boundaries" q --hessian backprop-kfac --bwd-boundaries many --out "$T/x"
expect 1 "--bwd-boundaries: expected auto or an integer in \[0, 4096\], got '4097'" \
    q --hessian backprop-kfac --bwd-boundaries 4097 --out "$T/x"
# a budget for the naive flow, which holds no boundary matrices: a contradiction (0 and
# auto, the default, are not)
expect 1 "--bwd-boundaries 5 and --bwd-flow naive contradict each other" \
    q --hessian backprop-kfac --bwd-flow naive --bwd-boundaries 5 --out "$T/x"
expect 1 "--progress-interval" q --hessian backprop-kfac --progress-interval -1 --out "$T/x"
mkdir -p "$T/acts"
expect 1 "--calib" "$B" quantize "$K" --activations "$T/acts" --hessian backprop-kfac --out "$T/x"
expect 2 "lm_head" "$B" quantize "$BAD/missing_lm_head" --calib "$K/calib.safetensors" \
    --hessian backprop-kfac --out "$T/x"
[ ! -e "$T/x" ] || fail "a failed run left $T/x behind"
echo "1 passed, 0 failed"
