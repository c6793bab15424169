#!/usr/bin/env bash
# CLI test of `bakron quantize` as a user types it (issue 17, issue 14 points
# 7 and 11): the model path in its three spellings, every mistake found
# before the work and reported on its own line with the documented exit code,
# --layers out of range, one layer numbering, presets by name with field-by-
# field overrides and positioned parse errors, the GPTQ group rule, JSON
# error/interrupted events with a real ETA, --version on every command,
# --dry-run. Run by meson as test 'cli_quantize' (suite cpu).
set -u

: "${BK_BAKRON:?BK_BAKRON must point to the bakron executable}"
: "${BK_SOURCE_ROOT:?BK_SOURCE_ROOT must point to the source tree}"
: "${BK_BUILD_ROOT:?BK_BUILD_ROOT must point to the build tree}"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/bk_cli_quantize.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
failures=0
checks=0
M="$BK_SOURCE_ROOT/examples/kerneldocs-1.6m"
CAL="$M/calib.safetensors"

fail() {
    echo "FAIL: $label: $*" >&2
    failures=$((failures + 1))
}

# run ARGS...: stdout/stderr in $tmp/out, $tmp/err, exit code in $rc
run() {
    "$BK_BAKRON" "$@" >"$tmp/out" 2>"$tmp/err"
    rc=$?
    checks=$((checks + 1))
}
expect_rc() {
    [ "$rc" -eq "$1" ] || fail "exit $rc, expected $1; stderr: $(head -5 "$tmp/err")"
}
# expect_err REGEX: some stderr line matches
expect_err() {
    grep -Eq -- "$1" "$tmp/err" || { fail "no stderr line matching '$1':"; sed 's/^/    | /' "$tmp/err" | head -20 >&2; }
}
expect_out() {
    grep -Eq -- "$1" "$tmp/out" || { fail "no stdout line matching '$1':"; sed 's/^/    | /' "$tmp/out" | head -20 >&2; }
}
no_output_folder() {
    if [ -e "$1" ] || ls -d "$1".tmp-* >/dev/null 2>&1; then fail "output or work folder $1 exists"; fi
}

# ------------------------------------------- 1. the model path, one prefix
label="model path: file, index, folder mean the folder (dry run)"
for mp in "$M" "$M/" "$M/model.safetensors" "$M/config.json"; do
    run quantize "$mp" --calib "$CAL" --hessian mlplocal-kfac --out "$tmp/o1" --dry-run
    expect_rc 0
    expect_out "^  model +.*llama BF16, 4 layers"
done
no_output_folder "$tmp/o1"
label="model path: sharded index.json"
run quantize "$BK_SOURCE_ROOT/tests/data/models/tiny-llama3/model.safetensors.index.json" \
    --hessian rtn --out "$tmp/o1" --dry-run
expect_rc 0
expect_out "layers +0\.\.1 \(2 of 2"

label="the issue's command: each missing piece on its own line, usage exit 1, one prefix"
run quantize "$M/model.safetensors" --hessian mlplocal-kfac
expect_rc 1
[ "$(wc -l <"$tmp/err")" -eq 2 ] || fail "expected 2 error lines, got: $(cat "$tmp/err")"
expect_err "^bakron quantize: error: --out OUT_DIR is required"
expect_err "^bakron quantize: error: --hessian mlplocal-kfac needs calibration data"
grep -q "error: quantize:" "$tmp/err" && fail "doubled prefix: $(cat "$tmp/err")"
[ -s "$tmp/out" ] && fail "printed on stdout"

# ------------------------------------------ 2 / 14.7: every check up front
label="every mistake in one run, each on its own line"
run quantize "$M" --calib "$tmp/missing.safetensors" --layers 3:9 --export gptq --bits 4 \
    --asym --group 100 --bogus --out "$tmp/o2"
expect_rc 1
expect_err "unknown option '--bogus'"
expect_err "--asym and --export gptq conflict"
expect_err "--layers 3:9: the model has 4 layers"
expect_err "--group 100 does not divide the input dimension of self_attn\.q_proj \(192\).*mlp\.down_proj \(512\)"
expect_err "missing\.safetensors"
n=$(grep -c "^bakron quantize: error: " "$tmp/err")
[ "$n" -eq 5 ] || fail "expected 5 error lines, got $n: $(cat "$tmp/err")"
no_output_folder "$tmp/o2"

label="bad input alone: exit 2"
run quantize "$M" --calib "$tmp/missing.safetensors" --out "$tmp/o2"
expect_rc 2
label="a non-empty --out is refused before any work (exit 1)"
mkdir -p "$tmp/full" && echo x >"$tmp/full/keep"
run quantize "$M" --calib "$CAL" --hessian gptq --out "$tmp/full"
expect_rc 1
expect_err "--out .*full: exists and is not empty"
grep -q "layer" "$tmp/err" && fail "work started: $(cat "$tmp/err")"
[ "$(cat "$tmp/full/keep")" = x ] || fail "the old output was touched"
label="--out an existing file (exit 1)"
run quantize "$M" --calib "$CAL" --out "$tmp/full/keep"
expect_rc 1
expect_err "exists and is a regular file, not a folder"
label="--out '' (exit 1)"
run quantize "$M" --calib "$CAL" --out ''
expect_rc 1
expect_err "--out: empty path"
label="--out in a folder that cannot be written (exit 3)"
if [ "$(id -u)" -ne 0 ]; then
    mkdir -p "$tmp/ro" && chmod 555 "$tmp/ro"
    run quantize "$M" --calib "$CAL" --out "$tmp/ro/q"
    expect_rc 3
    expect_err "cannot create the output in .*ro"
    chmod 755 "$tmp/ro"
fi
label="not enough free space for the estimated output (exit 3, before any work)"
mkdir -p "$tmp/small"
if [ "$(id -u)" -eq 0 ] && mount -t tmpfs -o size=1m tmpfs "$tmp/small" 2>/dev/null; then
    run quantize "$M" --hessian rtn --export dequantized --out "$tmp/small/q"
    expect_rc 3
    expect_err "--out .*small/q: the output needs about [0-9.]+ MiB and [0-9.]+ MiB are free there"
    [ -z "$(ls -A "$tmp/small")" ] || fail "something was written: $(ls -A "$tmp/small")"
    umount "$tmp/small"
else
    echo "skipped: free-space check (needs root and tmpfs)"
fi
label="config.json with a NUL byte in a key: refused at the start (exit 2)"
mkdir -p "$tmp/nulmodel"
cp "$M/model.safetensors" "$tmp/nulmodel/"
python3 -c '
import sys
t = open(sys.argv[1], "rb").read()
i = t.index(b"\"hidden_act\"")
open(sys.argv[2], "wb").write(t[:i + 3] + b"\0" + t[i + 3:])' "$M/config.json" "$tmp/nulmodel/config.json"
run quantize "$tmp/nulmodel" --calib "$CAL" --out "$tmp/o3"
expect_rc 2
expect_err "config\.json: a NUL byte at offset [0-9]+"
no_output_folder "$tmp/o3"

label="a 17 MB config.json: one size limit, read at the start and by the output alike"
mkdir -p "$tmp/bigcfg"
cp "$M/model.safetensors" "$tmp/bigcfg/"
python3 -c '
import sys
t = open(sys.argv[1]).read().rstrip()
open(sys.argv[2], "w").write(t[:-1] + " " * (17 << 20) + "}\n")' "$M/config.json" "$tmp/bigcfg/config.json"
run quantize "$tmp/bigcfg" --hessian rtn --backend cpu --out "$tmp/o-big"
expect_rc 0
[ -f "$tmp/o-big/config.json" ] || fail "no output config.json"
rm -rf "$tmp/bigcfg" "$tmp/o-big"

label="--dry-run prints the plan, computes nothing, exits 0"
run quantize "$M" --calib "$CAL" --hessian fullylocal-kfac --samples 8 --out "$tmp/o4" --dry-run
expect_rc 0
expect_out "^  calibration +.*8 sequences x 256 tokens"
expect_out "^    self_attn\.q_proj +\[192 x 192\] +two-sided"
expect_out "^    mlp\.down_proj +\[192 x 512\] +one-sided"
expect_out "^  estimated host memory +[0-9.]+ (KiB|MiB|GiB)"
expect_out "^  estimated output size +[0-9.]+ (KiB|MiB|GiB)"
no_output_folder "$tmp/o4"
run quantize "$M" --calib "$CAL" --out "$tmp/o4" --dry-run --json
expect_rc 0
python3 -c '
import json, sys
d = json.loads(open(sys.argv[1]).read())
assert d["event"] == "plan" and d["layers_total"] == 4 and len(d["modules"]) == 7, d
assert d["estimated_output_bytes"] > 0 and d["estimated_host_bytes"] > 0, d' "$tmp/out" \
    || fail "--dry-run --json: not the expected plan event: $(cat "$tmp/out")"

# --------------------------------------------------------- 3. --layers
label="--layers 3:9 on a 4-layer model"
run quantize "$M" --calib "$CAL" --layers 3:9 --out "$tmp/o5"
expect_rc 1
expect_err "^bakron quantize: error: --layers 3:9: the model has 4 layers \(numbered 0\.\.3\)"
label="--layers 4: on a 4-layer model"
run quantize "$M" --calib "$CAL" --layers 4: --out "$tmp/o5"
expect_rc 1
no_output_folder "$tmp/o5"

# --------------------------------------- 7 / 14.11: GPTQ rules, conflicts
label="--export gptq --group 64 divides every input dimension: accepted"
run quantize "$M" --calib "$CAL" --export gptq --bits 4 --group 64 --out "$tmp/o6" --dry-run
expect_rc 0
label="--export gptq --group 128 on 192 columns (exit 1, names the module)"
run quantize "$M" --calib "$CAL" --export gptq --bits 4 --group 128 --out "$tmp/o6"
expect_rc 1
expect_err "--group 128 does not divide the input dimension of self_attn\.q_proj \(192\)"
grep -q "down_proj" "$tmp/err" && fail "down_proj (512 columns) named although 128 divides it"
label="--asym --export gptq (exit 1 at once)"
run quantize "$M" --calib "$CAL" --export gptq --bits 4 --asym --out "$tmp/o6"
expect_rc 1
[ "$(wc -l <"$tmp/err")" -eq 1 ] || fail "expected one line: $(cat "$tmp/err")"
label="--gpu-pipeline --backend cpu (exit 1 at once, a usage conflict in every build)"
run quantize "$M" --calib "$CAL" --gpu-pipeline --backend cpu --out "$tmp/o6"
expect_rc 1
expect_err "--gpu-pipeline and --backend cpu contradict each other"
[ ! -e "$tmp/o6" ] || fail "--out created although the options conflict"

# ------------------------------------------------- 5. presets
label="preset by name from the build folder, --levels replaces its bits/group"
run quantize "$M" --calib "$CAL" --config w4g128-gptq --levels 3 --out "$tmp/o7" --dry-run
expect_rc 0
expect_out "^  quantizer +levels=3"
label="preset by name, --group overrides its group only"
run quantize "$M" --calib "$CAL" --config w4g128-gptq --group 64 --out "$tmp/o7" --dry-run
expect_rc 0
expect_out "^  quantizer +uniform bits=4 group=64"
label="preset by name: unknown name lists the presets"
run quantize "$M" --calib "$CAL" --config no-such-preset --out "$tmp/o7"
expect_rc 1
expect_err "no-such-preset: no such file or installed preset \(presets: .*paper-2\.81bit-gptq"
label="presets installed by meson, found by name next to the installed executable"
if command -v meson >/dev/null 2>&1 &&
    meson install -C "$BK_BUILD_ROOT" --destdir "$tmp/inst" --no-rebuild --quiet >"$tmp/inst.log" 2>&1; then
    exe=$(find "$tmp/inst" -path '*/bin/bakron' -type f | head -1)
    preset=$(find "$tmp/inst" -path '*/share/bakron/configs/paper-2.81bit-gptq.json' | head -1)
    [ -n "$preset" ] || fail "configs/ not installed under share/bakron/configs"
    man=$(find "$tmp/inst" -path '*/man1/bakron.1' | head -1)
    [ -n "$man" ] || fail "no man page installed (man1/bakron.1)"
    if [ -n "$exe" ]; then
        "$exe" quantize "$M" --calib "$CAL" --config paper-2.81bit-gptq --out "$tmp/o7" --dry-run \
            >"$tmp/out" 2>"$tmp/err"
        rc=$?
        expect_rc 0
        expect_out "^  hessian +gptq"
        expect_out "^  quantizer +levels=3"
    else
        fail "no bin/bakron installed"
    fi
else
    fail "meson install --destdir failed: $(tail -3 "$tmp/inst.log" 2>/dev/null)"
fi
label="truncated preset: file and line:column"
printf '{\n  "hessian": "gptq",\n  "bits": 4' >"$tmp/trunc.json"
run quantize "$M" --calib "$CAL" --config "$tmp/trunc.json" --out "$tmp/o7"
expect_rc 2
expect_err "trunc\.json:3:12: invalid JSON \(the file ends early\)"
label="preset with a bad value: file and line:column of the key"
printf '{\n  "hessian": "gptq",\n    "levels": 300\n}\n' >"$tmp/bad.json"
run quantize "$M" --calib "$CAL" --config "$tmp/bad.json" --out "$tmp/o7"
expect_rc 2
expect_err "bad\.json:3:5: --levels: expected an integer in \[1, 127\]"

# --------------------------------- 4 / 8. numbering, JSON events, ETA
label="progress numbers layers from 0 like --layers and errors"
run quantize "$M" --calib "$CAL" --samples 4 --seqlen 32 --hessian gptq --layers 2:4 \
    --backend cpu --out "$tmp/o8"
expect_rc 0
expect_err "^  layer 2 \(1/2\) self_attn\.q_proj"
expect_err "^layer 3 done \(2/2\)"
grep -Eq "layer [0-9]+/" "$tmp/err" && fail "old 1-based 'layer k/n' numbering: $(grep -E 'layer [0-9]+/' "$tmp/err" | head -2)"

label="--json: layers_total, layers_selected, a real eta_s"
run quantize "$M" --calib "$CAL" --samples 4 --seqlen 32 --hessian gptq --layers 1:3 \
    --backend cpu --out "$tmp/o9" --json
expect_rc 0
python3 -c '
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
mods = [e for e in ev if e["event"] == "module"]
assert len(mods) == 14, len(mods)
assert all(e["layers_total"] == 4 and e["layers_selected"] == 2 for e in ev), ev[0]
assert "layers" not in ev[0]
assert {e["layer"] for e in mods} == {1, 2}
assert all(e["eta_s"] > 0 for e in mods[:-1]), [e["eta_s"] for e in mods]
assert mods[-1]["eta_s"] == 0' "$tmp/out" || fail "JSON events: $(head -3 "$tmp/out")"

label="--json: an error event (code, message, layer, module) on a failure mid-run"
BK_FAULT_WRITE_MODULE=3 "$BK_BAKRON" quantize "$M" --calib "$CAL" --samples 4 --seqlen 32 \
    --hessian gptq --backend cpu --out "$tmp/o10" --json >"$tmp/out" 2>"$tmp/err"
rc=$?
expect_rc 3
python3 -c '
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
e = ev[-1]
assert e["event"] == "error" and e["code"] == "WRITE" and e["exit_code"] == 3, e
assert "injected fault" in e["message"] and isinstance(e["layer"], int), e
assert "module" in e' "$tmp/out" || fail "no error event: $(tail -2 "$tmp/out")"
no_output_folder "$tmp/o10"

label="--json: errors found before the work are error events too"
run quantize "$M" --layers 3:9 --out "$tmp/o11" --json
expect_rc 1
python3 -c '
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
assert len(ev) == 2 and all(e["event"] == "error" and e["code"] == "USAGE" and e["layer"] is None for e in ev), ev' \
    "$tmp/out" || fail "error events: $(cat "$tmp/out")"

label="--json: SIGINT gives an interrupted event"
"$BK_BAKRON" quantize "$M" --calib "$CAL" --samples 16 --hessian mlplocal-kfac --backend cpu \
    --out "$tmp/o12" --json >"$tmp/out" 2>"$tmp/err" &
pid=$!
for _ in $(seq 1 600); do
    grep -q '"event":"module"' "$tmp/out" 2>/dev/null && break
    sleep 0.1
done
kill -INT "$pid" 2>/dev/null
wait "$pid"
rc=$?
checks=$((checks + 1))
expect_rc 3
python3 -c '
import json, sys
e = json.loads(open(sys.argv[1]).read().splitlines()[-1])
assert e["event"] == "interrupted" and e["code"] == "INTERRUPTED" and isinstance(e["layer"], int), e' \
    "$tmp/out" || fail "no interrupted event: $(tail -2 "$tmp/out")"
no_output_folder "$tmp/o12"

# ------------------------------- 5b. the stages hear of the next module
# The driver tells the stages which module is solved next from the same sums
# (bk_stage_ops.prepare_next, between a module's factors and its solve):
# q -> k, k -> v, gate -> up per layer (sequential), every module but down
# with --no-sequential. The CPU stages do nothing with it; the profile
# counts the calls (4 layers).
prepare_next_count() { # OUT WANT WHY [quantize options]
    local out=$1 want=$2 why=$3
    shift 3
    BK_PROFILE=1 run quantize "$M" --calib "$CAL" --samples 4 --seqlen 64 \
        --hessian mlplocal-kfac --backend cpu --out "$tmp/$out" "$@"
    expect_rc 0
    n=$(awk '$1 == "profile" && $2 == "pipe.prepare_next" {print $4}' "$tmp/err")
    [ "${n:-0}" = "$want" ] || fail "pipe.prepare_next count '${n:-none}', expected $want ($why)"
}
label="prepare_next: called for q->k, k->v, gate->up"
prepare_next_count pn1 12 "3 per layer"
label="prepare_next: --no-sequential, every module but the last"
prepare_next_count pn2 24 "6 per layer" --no-sequential

# ------------------------------- 6. every export is readable back
label="eval and inspect read native, dequantized and gptq exports"
for e in native dequantized gptq; do
    run quantize "$M" --calib "$CAL" --samples 4 --seqlen 64 --hessian gptq --bits 4 --group 64 \
        --export "$e" --backend cpu --out "$tmp/x-$e"
    expect_rc 0
    run inspect "$tmp/x-$e"
    expect_rc 0
    case $e in
        native) expect_out "^  quantized +yes \(bakron native\)" ;;
        dequantized) expect_out "^  quantized +no" ;;
        gptq) expect_out "^  quantized +yes \(GPTQ v1\)" ;;
    esac
    run eval "$tmp/x-$e" --tokens "$M/eval.safetensors" --samples 8 --backend cpu --json
    expect_rc 0
    cp "$tmp/out" "$tmp/nll-$e.json"
done
label="eval: the gptq export's NLL equals the dequantized export's (to BF16/F16 rounding)"
python3 -c '
import json, sys
g = json.load(open(sys.argv[1]))["nll"]; d = json.load(open(sys.argv[2]))["nll"]
n = json.load(open(sys.argv[3]))["nll"]
print(f"nll gptq {g:.6f} dequantized {d:.6f} native {n:.6f}")
assert abs(g - d) < 1e-3 * abs(d), (g, d)
assert abs(n - d) < 1e-3 * abs(d), (n, d)' "$tmp/nll-gptq.json" "$tmp/nll-dequantized.json" \
    "$tmp/nll-native.json" || fail "NLLs differ"
label="the gptq export unpacked independently (Python) equals the dequantized export"
python3 - "$tmp/x-gptq/model.safetensors" "$tmp/x-dequantized/model.safetensors" <<'PY' || fail "unpacked GPTQ weights differ"
import json, struct, sys
def load(p):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
    out = {}
    for k, v in h.items():
        if k == "__metadata__": continue
        raw = b[8 + n + v["data_offsets"][0]: 8 + n + v["data_offsets"][1]]
        cnt = len(raw) // {"BF16": 2, "F16": 2, "I32": 4, "F32": 4}[v["dtype"]]
        if v["dtype"] == "BF16":
            a = [struct.unpack("<f", struct.pack("<I", u << 16))[0] for u in struct.unpack(f"<{cnt}H", raw)]
        else:
            a = list(struct.unpack(f"<{cnt}" + {"I32": "I", "F16": "e", "F32": "f"}[v["dtype"]], raw))
        out[k] = (a, v["shape"])
    return out
g, d = load(sys.argv[1]), load(sys.argv[2])
bits, checked, worst = 4, 0, 0.0
for k in d:
    if not k.endswith("_proj.weight"): continue
    p = k[:-len(".weight")]
    ref, (o_, i_) = d[k][0], d[k][1]
    qw, (_, out) = g[p + ".qweight"]
    qz = g[p + ".qzeros"][0]
    sc = g[p + ".scales"][0]
    gi = g[p + ".g_idx"][0]
    assert out == o_
    per = 32 // bits
    amax = max(abs(x) for x in ref)
    for r in range(o_):
        for c in range(i_):
            q = (qw[(c // per) * out + r] >> (bits * (c % per))) & 0xF
            grp = gi[c]
            z = (qz[grp * (out // per) + r // per] >> (bits * (r % per))) & 0xF
            w = (q - (z + 1)) * sc[grp * out + r]
            worst = max(worst, abs(w - ref[r * i_ + c]) / amax)
    checked += 1
assert checked == 28, checked
assert worst < 1e-2, worst
print("unpacked", checked, "modules, worst relative difference", worst)
PY

# ------------------------- 11. model card, activation dumps' dtype and summary
label="quantized outputs carry their own model card, not the source README"
for e in native gptq dequantized; do
    cmp -s "$M/README.md" "$tmp/x-$e/README.md" && fail "$e: the source README was copied"
    grep -q "<!-- bakron model card -->" "$tmp/x-$e/README.md" || fail "$e: no model card"
    grep -Eq "^\| Hessian \| gptq \|" "$tmp/x-$e/README.md" || fail "$e: card lacks the Hessian"
    grep -Eq "^\| quantizer \| uniform 4-bit, symmetric, groups of 64 input columns" "$tmp/x-$e/README.md" ||
        fail "$e: card lacks the quantizer"
    grep -Eq "^\| calibration \| calib\.safetensors: 4 sequences x 64 tokens \|" "$tmp/x-$e/README.md" ||
        fail "$e: card lacks the calibration"
done
grep -Eq "^\| eval\.safetensors \| 8 x 256 \| [0-9.]+ \| [0-9.]+ \|$" "$tmp/x-gptq/README.md" ||
    fail "eval did not record its perplexity in the card: $(tail -3 "$tmp/x-gptq/README.md")"
label="eval again with the same tokens replaces the row"
run eval "$tmp/x-gptq" --tokens "$M/eval.safetensors" --samples 8 --backend cpu
expect_rc 0
expect_out "^recorded +in .*x-gptq/README\.md"
[ "$(grep -c '^| eval\.safetensors | 8 x 256 |' "$tmp/x-gptq/README.md")" -eq 1 ] || fail "duplicate rows"
label="eval of a plain checkpoint writes nothing into it"
cp -r "$M" "$tmp/plain"
run eval "$tmp/plain" --tokens "$M/eval.safetensors" --samples 2 --backend cpu
expect_rc 0
cmp -s "$M/README.md" "$tmp/plain/README.md" || fail "the source README was changed by eval"

label="dump-activations: BF16 by default for a BF16 model, closing summary"
run dump-activations "$M" --calib "$CAL" --samples 2 --seqlen 32 --backend cpu --out "$tmp/d1"
expect_rc 0
grep -q '"dtype":[[:space:]]*"BF16"' "$tmp/d1/manifest.json" || fail "default dtype is not BF16"
nf=$(find "$tmp/d1" -type f | wc -l)
nb=$(find "$tmp/d1" -type f -printf '%s\n' | awk '{s += $1} END {print s}')
expect_err "^bakron: dumped .*d1: $nf files, [0-9.]+ (KiB|MiB|GiB) \(BF16\) in [0-9.]+s$"
run dump-activations "$M" --calib "$CAL" --samples 2 --seqlen 32 --backend cpu --dtype f32 --json --out "$tmp/d2"
expect_rc 0
grep -q '"dtype":[[:space:]]*"F32"' "$tmp/d2/manifest.json" || fail "--dtype f32 not honoured"
python3 -c '
import json, sys
e = json.loads(open(sys.argv[1]).read().splitlines()[-1])
assert e["event"] == "summary" and e["dtype"] == "F32" and e["files"] == int(sys.argv[2]), e' \
    "$tmp/out" "$(find "$tmp/d2" -type f | wc -l)" || fail "no summary event: $(tail -1 "$tmp/out")"
d1b=$nb
d2b=$(find "$tmp/d2" -type f -printf '%s\n' | awk '{s += $1} END {print s}')
[ "$d2b" -gt $((d1b * 3 / 2)) ] || fail "the F32 dump ($d2b bytes) is not about twice the BF16 one ($d1b)"
run dump-activations "$M" --calib "$CAL" --dtype f64 --out "$tmp/d3"
expect_rc 1

# -------------------------------------------------- 12. --version
for cmd in quantize eval dump-activations inspect solve bench; do
    label="$cmd --version"
    run "$cmd" --version
    expect_rc 0
    expect_out "^bakron [0-9]+\.[0-9]+\.[0-9]+"
done

label="the man page: every command's help text"
manp="$BK_BUILD_ROOT/bakron.1"
if [ -f "$manp" ]; then
    grep -q '^\.TH BAKRON 1' "$manp" || fail "no .TH line"
    for cmd in quantize eval dump-activations merge inspect solve bench; do
        grep -q "^\.SS \"bakron $cmd\"" "$manp" || fail "no section for $cmd"
    done
    grep -q -- 'dry\\-run\|dry-run' "$manp" || fail "quantize's --dry-run is not in the man page"
    if command -v man >/dev/null 2>&1; then
        MANWIDTH=80 man -l "$manp" >"$tmp/man.txt" 2>"$tmp/man.err" || fail "man -l: $(cat "$tmp/man.err")"
        grep -q "EXIT STATUS" "$tmp/man.txt" || fail "man -l: no EXIT STATUS section"
    fi
else
    fail "no man page built at $manp"
fi

echo "cli_quantize: $checks runs, $failures failure(s)"
[ "$failures" -eq 0 ]
