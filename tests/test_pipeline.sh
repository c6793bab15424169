#!/usr/bin/env bash
# End-to-end quantization of the bundled kerneldocs-1.6m model on the CPU:
#  - perplexity ordering FP < gptq < rtn (2.81 bits, the paper's setting);
#  - every native output re-evaluates to the perplexity of the same job
#    exported as an ordinary dequantized checkpoint;
#  - activation dumps: dump-activations -> quantize --activations;
#  - bad inputs exit 2 with one line; an interrupted run leaves no folder.
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die

# Calibration: 32 of the 128 calibration windows keep the test fast.
CAL="--calib $M/calib.safetensors --samples 32"
EV="--tokens $M/eval.safetensors --samples 32"

ppl() { # folder -> perplexity (from --json)
    "$B" eval "$1" $EV --json 2>"$W/eval.err" | python3 -c 'import json,sys; print(json.load(sys.stdin)["perplexity"])'
}

fp=$(ppl "$M") || die "eval FP"
echo "FP perplexity: $fp"

declare -A P
for h in rtn gptq mlplocal-kfac fullylocal-shampoo; do
    for ex in native dequantized; do
        out="$W/q-$h-$ex"
        if ! "$B" quantize "$M" $CAL --hessian "$h" --levels 3 --export "$ex" --out "$out" \
             --json >"$W/log-$h-$ex.json" 2>"$W/err-$h-$ex"; then
            die "quantize $h $ex: $(cat "$W/err-$h-$ex")"
            continue
        fi
        [ -f "$out/report.json" ] || die "$h $ex: no report.json"
        [ -f "$out/config.json" ] || die "$h $ex: no config.json"
        P[$h-$ex]=$(ppl "$out") || die "eval $h $ex: $(cat "$W/eval.err")"
        echo "$h $ex perplexity: ${P[$h-$ex]}"
    done
    # the same job exported both ways evaluates the same (dequantized weights
    # are rounded to the model's BF16, hence the tolerance)
    python3 - "${P[$h-native]:-nan}" "${P[$h-dequantized]:-nan}" "$h" <<'EOF' || fail=1
import math, sys
a, b, h = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ok = math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 2e-3 * b
print(f"{h}: native {a:.5f} vs dequantized {b:.5f}: {'ok' if ok else 'MISMATCH'}")
sys.exit(0 if ok else 1)
EOF
done

python3 - "$fp" "${P[gptq-native]:-nan}" "${P[rtn-native]:-nan}" <<'EOF' || fail=1
import math, sys
fp, g, r = map(float, sys.argv[1:4])
ok = math.isfinite(g) and math.isfinite(r) and fp < g < r
print(f"ordering FP {fp:.4f} < gptq {g:.4f} < rtn {r:.4f}: {'ok' if ok else 'VIOLATED'}")
sys.exit(0 if ok else 1)
EOF

# native quantized folders carry codes + scales, not weights
PYTHONPATH="$SRC/tests" python3 - "$W/q-gptq-native/model.safetensors" <<'EOF' || fail=1
import sys
from st_raw import read
h, _ = read(sys.argv[1])
q = h["model.layers.0.mlp.up_proj.qweight"]; s = h["model.layers.0.mlp.up_proj.scales"]
ok = q["dtype"] == "I8" and q["shape"] == [512, 192] and s["shape"] == [512, 1] \
     and "model.layers.0.mlp.up_proj.weight" not in h and "lm_head.weight" not in h
print("native layout:", "ok" if ok else "WRONG")
sys.exit(0 if ok else 1)
EOF

# a preset gives the same job as the options it holds; the command line wins over it
if "$B" quantize "$M" $CAL --config "$SRC/configs/paper-2.81bit-gptq.json" --out "$W/q-preset" \
     2>"$W/err-pr"; then
    cmp -s "$W/q-preset/model.safetensors" "$W/q-gptq-native/model.safetensors" \
        && echo "preset paper-2.81bit-gptq: same checkpoint as --hessian gptq --levels 3" \
        || die "preset paper-2.81bit-gptq: output differs from --hessian gptq --levels 3"
    grep -q '"preset"' "$W/q-preset/config.json" || die "preset not recorded in config.json"
else
    die "quantize --config: $(cat "$W/err-pr")"
fi
"$B" quantize "$M" $CAL --config "$SRC/configs/paper-2.81bit-gptq.json" --hessian rtn \
    --out "$W/q-preset-rtn" 2>/dev/null && grep -q '"hessian":.*"rtn"' "$W/q-preset-rtn/config.json" \
    && echo "command line overrides the preset" || die "command line did not override the preset"

# rtn needs no calibration data, and gives the same model without it
if "$B" quantize "$M" --hessian rtn --out "$W/q-rtn-nocal" 2>"$W/err-rn"; then
    pr=$(ppl "$W/q-rtn-nocal")
    [ "$pr" = "${P[rtn-native]:-x}" ] && echo "rtn without calibration: $pr (same)" \
        || die "rtn without calibration: $pr != ${P[rtn-native]:-?}"
else
    die "quantize rtn without --calib: $(cat "$W/err-rn")"
fi

# --no-sequential (full-precision inputs everywhere) with a fully-local Hessian
if "$B" quantize "$M" $CAL --hessian fullylocal-kfac --no-sequential --out "$W/q-nonseq" 2>"$W/err-ns"; then
    pn=$(ppl "$W/q-nonseq") && echo "fullylocal-kfac --no-sequential: $pn"
    python3 -c "import sys; a,f,r=map(float,sys.argv[1:]); sys.exit(0 if f < a < r else 1)" \
        "$pn" "$fp" "${P[rtn-native]:-1e9}" || die "--no-sequential perplexity $pn out of range"
else
    die "quantize --no-sequential: $(cat "$W/err-ns")"
fi

# --layers 1:3 quantizes layers 1 and 2 only; the others keep their weights
if "$B" quantize "$M" $CAL --hessian gptq --layers 1:3 --out "$W/q-layers" 2>"$W/err-ly"; then
    PYTHONPATH="$SRC/tests" python3 - "$W/q-layers/model.safetensors" <<'EOF' || fail=1
import sys
from st_raw import read
h, _ = read(sys.argv[1])
ok = all((f"model.layers.{l}.mlp.up_proj.qweight" in h) == (l in (1, 2)) and
         (f"model.layers.{l}.mlp.up_proj.weight" in h) == (l not in (1, 2)) for l in range(4))
print("--layers 1:3 layout:", "ok" if ok else "WRONG")
sys.exit(0 if ok else 1)
EOF
    pl=$(ppl "$W/q-layers") && echo "--layers 1:3: $pl"
    python3 -c "import sys; a,f,g=map(float,sys.argv[1:]); sys.exit(0 if f < a < g else 1)" \
        "$pl" "$fp" "${P[gptq-native]:-1e9}" || die "--layers perplexity $pl not between FP and all-layer gptq"
else
    die "quantize --layers: $(cat "$W/err-ly")"
fi

# GPTQ v1 export: unpack with an independent reader and compare with the native codes
if "$B" quantize "$M" $CAL --hessian gptq --levels 3 --export gptq --out "$W/q-gptq-gptq" \
     2>"$W/err-gg"; then
    PYTHONPATH="$SRC/tests" python3 - "$W/q-gptq-native/model.safetensors" "$W/q-gptq-gptq" <<'EOF' || fail=1
import array, json, struct, sys
from st_raw import read, tensor
nh, nd = read(sys.argv[1])
gh, gd = read(sys.argv[2] + "/model.safetensors")
cfg = json.load(open(sys.argv[2] + "/config.json"))["quantization_config"]
assert cfg["quant_method"] == "gptq" and cfg["bits"] == 3 and cfg["sym"] is True, cfg
bad = 0
for pre in ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.up_proj", "model.layers.3.mlp.down_proj"]:
    nt, nb = tensor(nh, nd, pre + ".qweight"); out, inn = nt["shape"]
    codes = array.array("b", nb)
    qt, qb = tensor(gh, gd, pre + ".qweight")
    assert qt["dtype"] == "I32" and qt["shape"] == [inn * 3 // 32, out], qt
    words = array.array("I", qb)
    zt, zb = tensor(gh, gd, pre + ".qzeros"); z = array.array("I", zb)
    zero = (z[0] & 7) + 1
    st, sb = tensor(gh, gd, pre + ".scales")
    assert st["dtype"] == "F16" and st["shape"] == [1, out], st
    for i in range(out):
        bits = 0; nbits = 0; k = 0
        for row in range(inn * 3 // 32):
            bits |= words[row * out + i] << nbits; nbits += 32
            while nbits >= 3:
                q = bits & 7; bits >>= 3; nbits -= 3
                if q - zero != codes[i * inn + k]: bad += 1
                k += 1
print("gptq export vs native codes:", "ok" if bad == 0 else f"{bad} MISMATCHES")
sys.exit(1 if bad else 0)
EOF
else
    die "quantize --export gptq: $(cat "$W/err-gg")"
fi

# activation dumps -> quantize
if "$B" dump-activations "$M" $CAL --dtype f32 --out "$W/acts" --zstd 2>"$W/err-dump"; then
    [ -f "$W/acts/manifest.json" ] || die "no manifest"
    [ -f "$W/acts/layer.0003.safetensors.zst" ] || die "no zstd layer file"
    if "$B" quantize "$M" --activations "$W/acts" --hessian mlplocal-kfac --out "$W/q-acts" \
        2>"$W/err-qa"; then
        pa=$(ppl "$W/q-acts") && echo "from activations (full-precision inputs): $pa"
        python3 -c "import sys; a,f,r=map(float,sys.argv[1:]); sys.exit(0 if f < a < r else 1)" \
            "$pa" "$fp" "${P[rtn-native]:-1e9}" || die "activations run perplexity $pa out of range"
    else
        die "quantize --activations: $(cat "$W/err-qa")"
    fi
else
    die "dump-activations: $(cat "$W/err-dump")"
fi

# bad inputs: exit 2, exactly one line on stderr, no output folder
expect_bad() { # name, then the command
    local name=$1; shift
    "$@" >/dev/null 2>"$W/bad.err"
    local rc=$? lines
    lines=$(wc -l <"$W/bad.err")
    if [ $rc -ne 2 ] || [ "$lines" -ne 1 ]; then
        die "$name: exit $rc, $lines stderr lines: $(cat "$W/bad.err")"
    else
        echo "$name: exit 2: $(cat "$W/bad.err")"
    fi
}
python3 - "$W" <<'EOF'
import json, os, struct, sys
w = sys.argv[1]
def save(path, name, dtype, shape, data):
    hdr = {name: {"dtype": dtype, "shape": shape, "data_offsets": [0, len(data)]},
           "__metadata__": {"format": "pt"}}
    hb = json.dumps(hdr).encode(); hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + data)
save(f"{w}/oov.safetensors", "input_ids", "I32", [2, 4], struct.pack("<8i", 1, 2, 3, 4, 5, 300, 7, 8))
save(f"{w}/short.safetensors", "input_ids", "I32", [2, 1], struct.pack("<2i", 1, 2))
save(f"{w}/float.safetensors", "input_ids", "F32", [1, 4], struct.pack("<4f", 1, 2, 3, 4))
EOF
expect_bad "tokens out of vocabulary" "$B" quantize "$M" --calib "$W/oov.safetensors" --hessian gptq --out "$W/bad1"
expect_bad "too-short sequences" "$B" quantize "$M" --calib "$W/short.safetensors" --hessian gptq --out "$W/bad2"
expect_bad "float token ids" "$B" quantize "$M" --calib "$W/float.safetensors" --hessian gptq --out "$W/bad3"
if [ -d "$W/acts" ]; then
    cp -r "$W/acts" "$W/acts-missing"; rm "$W/acts-missing/layer.0002.safetensors.zst"
    expect_bad "missing layer file" "$B" quantize "$M" --activations "$W/acts-missing" --hessian gptq --out "$W/bad4"
    cp -r "$W/acts" "$W/acts-layers"
    sed -i 's/"layers":\t4/"layers":\t3/; s/"layers": 4/"layers": 3/' "$W/acts-layers/manifest.json"
    expect_bad "layer count mismatch" "$B" quantize "$M" --activations "$W/acts-layers" --hessian gptq --out "$W/bad5"
    cp -r "$W/acts" "$W/acts-hidden"
    sed -i 's/"hidden_size":\t192/"hidden_size":\t128/; s/"hidden_size": 192/"hidden_size": 128/' "$W/acts-hidden/manifest.json"
    expect_bad "shape mismatch" "$B" quantize "$M" --activations "$W/acts-hidden" --hessian gptq --out "$W/bad6"
    cp -r "$W/acts" "$W/acts-dtype"
    sed -i 's/"dtype":\t"F32"/"dtype":\t"BF16"/; s/"dtype": "F32"/"dtype": "BF16"/' "$W/acts-dtype/manifest.json"
    expect_bad "dtype mismatch" "$B" quantize "$M" --activations "$W/acts-dtype" --hessian gptq --out "$W/bad7"
fi
# a NaN in a weight: refused before any work
cp -r "$M" "$W/nanmodel"; chmod -R u+w "$W/nanmodel"
python3 - "$W/nanmodel/model.safetensors" <<'EOF'
import json, struct, sys
b = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
off = 8 + n + h["model.layers.2.mlp.up_proj.weight"]["data_offsets"][0] + 2 * 100
b[off:off + 2] = b"\xc0\x7f"  # BF16 NaN
open(sys.argv[1], "wb").write(b)
EOF
expect_bad "NaN weight" "$B" quantize "$W/nanmodel" $CAL --hessian gptq --out "$W/bad8"
grep -q "up_proj" "$W/bad.err" || die "NaN weight: message does not name the tensor"

# GPU options: bad values are usage errors (exit 1); --gpu-pipeline with --cpu-stages is a
# contradiction (a usage error too, exit 1); --cpu-stages on the CPU backend changes nothing
"$B" quantize "$M" $CAL --hessian gptq --gpu-math fp16 --out "$W/bad10" >/dev/null 2>"$W/gm.err"
rc=$?
{ [ $rc -eq 1 ] && grep -q "gpu-math" "$W/gm.err"; } || die "--gpu-math fp16: exit $rc: $(cat "$W/gm.err")"
"$B" dump-activations "$M" --calib "$M/calib.safetensors" --gpu-math x --out "$W/bad11" >/dev/null 2>"$W/gm.err"
rc=$?
{ [ $rc -eq 1 ] && grep -q "gpu-math" "$W/gm.err"; } || die "dump --gpu-math x: exit $rc: $(cat "$W/gm.err")"
"$B" quantize "$M" $CAL --hessian gptq --gpu-pipeline --cpu-stages --out "$W/bad12" >/dev/null 2>"$W/gm.err"
rc=$?
{ [ $rc -eq 1 ] && [ "$(wc -l <"$W/gm.err")" -eq 1 ] && grep -q "cpu-stages" "$W/gm.err"; } ||
    die "--gpu-pipeline with --cpu-stages: exit $rc: $(cat "$W/gm.err")"
if "$B" quantize "$M" $CAL --hessian gptq --layers 0:1 --backend cpu --cpu-stages \
     --out "$W/q-cs" 2>"$W/cs.err" >/dev/null; then
    grep -qE '"stages":[[:space:]]*"cpu"' "$W/q-cs/report.json" || die "--cpu-stages: report.json does not say stages cpu"
else
    die "--cpu-stages --backend cpu: $(cat "$W/cs.err")"
fi
# --damp-b-attn: the q/k/v output factors get their own damping, gate/up keep --damp-b
if "$B" quantize "$M" --calib "$M/calib.safetensors" --samples 8 --hessian fullylocal-kfac \
     --damp-b 8 --damp-b-attn 0.25 --layers 0:1 --out "$W/q-dba" --json >"$W/dba.json" 2>"$W/dba.err"; then
    python3 - "$W/dba.json" "$W/q-dba/config.json" <<'EOF4' || die "--damp-b-attn"
import json, sys
want = {"self_attn.q_proj": 0.25, "self_attn.k_proj": 0.25, "self_attn.v_proj": 0.25,
        "mlp.gate_proj": 8, "mlp.up_proj": 8}
got = {}
for line in open(sys.argv[1]):
    e = json.loads(line)
    if e.get("module") in want and "damp_b" in e:
        got[e["module"]] = e["damp_b"]
qc = json.load(open(sys.argv[2]))["quantization_config"]
ok = got == want and qc.get("damp_b") == 8 and qc.get("damp_b_attn") == 0.25
print("--damp-b-attn:", got, qc.get("damp_b"), qc.get("damp_b_attn"), "ok" if ok else "WRONG")
sys.exit(0 if ok else 1)
EOF4
else
    die "--damp-b-attn: $(cat "$W/dba.err")"
fi
# without a usable GPU, --backend cuda fails in one line (exit 3) and leaves nothing
"$B" eval "$M" $EV --backend cuda >/dev/null 2>"$W/probe.err"
if [ $? -eq 3 ] && grep -qE "no usable CUDA device|no CUDA backend" "$W/probe.err"; then
    "$B" dump-activations "$M" --calib "$M/calib.safetensors" --samples 2 --backend cuda \
        --out "$W/bad13" >/dev/null 2>"$W/d13.err"
    rc=$?
    { [ $rc -eq 3 ] && [ "$(wc -l <"$W/d13.err")" -eq 1 ]; } ||
        die "dump-activations --backend cuda without a GPU: exit $rc: $(cat "$W/d13.err")"
    "$B" quantize "$M" $CAL --hessian gptq --backend cuda --out "$W/bad14" >/dev/null 2>"$W/d14.err"
    rc=$?
    { [ $rc -eq 3 ] && [ "$(wc -l <"$W/d14.err")" -eq 1 ]; } ||
        die "quantize --backend cuda without a GPU: exit $rc: $(cat "$W/d14.err")"
fi

# no room for the output (a file-size limit stands in for a full disk): exit 3, one line
# the down_proj inputs recomputed in stage OUT (--setting keep_down=0) instead of
# kept between the stages: the same bytes
if "$B" quantize "$M" $CAL --hessian gptq --levels 3 --setting keep_down=0 --out "$W/q-rec" \
    >/dev/null 2>"$W/rec.err"; then
    cmp -s "$W/q-rec/model.safetensors" "$W/q-gptq-native/model.safetensors" ||
        die "keep_down=0: other bytes than with the kept down_proj inputs"
    echo "keep_down=0: the same bytes"
else
    die "quantize --setting keep_down=0: $(cat "$W/rec.err")"
fi
# an unknown setting or a bad value: usage error (exit 1), one line naming it
for bad in nope=1 keep_down=2 mem_limit=-1 residual; do
    "$B" quantize "$M" $CAL --hessian gptq --setting "$bad" --out "$W/bads" >/dev/null 2>"$W/bads.err"
    rc=$?
    if [ $rc -ne 1 ] || [ "$(wc -l <"$W/bads.err")" -ne 1 ] || ! grep -q -- "--setting" "$W/bads.err"; then
        die "--setting $bad: exit $rc: $(cat "$W/bads.err")"
    fi
    [ -e "$W/bads" ] && die "--setting $bad: an output folder was left behind"
done

(trap '' XFSZ; ulimit -f 200; "$B" quantize "$M" $CAL --hessian gptq --out "$W/bad9" 2>"$W/full.err" >/dev/null)
rc=$?
if [ $rc -ne 3 ] || [ "$(grep -c 'error' "$W/full.err")" -ne 1 ]; then
    die "output too large for the disk: exit $rc: $(cat "$W/full.err")"
else
    echo "output too large for the disk: exit 3: $(grep error "$W/full.err")"
fi

# the tensors passed through (embedding, norms, head) are written by the writer
# thread while the first layer runs: the same bytes as written on the calling
# thread (BK_WRITER_THREAD=0), and a write of them failing there (a file-size
# limit of 8 KiB: the shard's first write fails, reserving its size)
# is one error line naming the output file, exit 3, nothing left behind
for wt in 1 0; do
    BK_WRITER_THREAD=$wt "$B" quantize "$M" $CAL --hessian gptq --levels 3 --out "$W/pt-$wt" \
        >/dev/null 2>"$W/pt-$wt.err" || die "quantize (writer thread $wt): $(cat "$W/pt-$wt.err")"
done
for f in "$W"/pt-1/*.safetensors; do
    cmp -s "$f" "$W/pt-0/$(basename "$f")" ||
        die "writer thread: $(basename "$f") differs from the one written on the calling thread"
done
for wt in 1 0; do
    (trap '' XFSZ; ulimit -f 8; BK_WRITER_THREAD=$wt "$B" quantize "$M" $CAL --hessian gptq \
        --out "$W/ptbad-$wt" 2>"$W/ptbad.err" >/dev/null)
    rc=$?
    if [ $rc -ne 3 ] || [ "$(grep -c error "$W/ptbad.err")" -ne 1 ] ||
        ! grep -q "ptbad-$wt\.tmp-[0-9]*/model.*\.safetensors: " "$W/ptbad.err"; then
        die "passthrough write failure (writer thread $wt): exit $rc: $(cat "$W/ptbad.err")"
    else
        echo "passthrough write failure (writer thread $wt): exit 3: $(grep error "$W/ptbad.err")"
    fi
    [ -e "$W/ptbad-$wt" ] && die "passthrough write failure: an output folder was left behind"
    ls -d "$W/ptbad-$wt".tmp-* >/dev/null 2>&1 && die "passthrough write failure: a temporary folder was left behind"
done

# a module write failing in the writer thread (fault injection), with and without the
# thread: exit 3, one line naming the module, nothing left behind
for wt in 1 0; do
    BK_WRITER_THREAD=$wt BK_FAULT_WRITE_MODULE=5 "$B" quantize "$M" $CAL --hessian gptq \
        --out "$W/bad15-$wt" >/dev/null 2>"$W/wf.err"
    rc=$?
    if [ $rc -ne 3 ] || [ "$(grep -c error "$W/wf.err")" -ne 1 ] || ! grep -q "layers.0.mlp.gate_proj" "$W/wf.err"; then
        die "write failure (writer thread $wt): exit $rc: $(cat "$W/wf.err")"
    else
        echo "write failure (writer thread $wt): exit 3: $(grep error "$W/wf.err")"
    fi
    [ -e "$W/bad15-$wt" ] && die "write failure: an output folder was left behind"
    ls -d "$W/bad15-$wt".tmp-* >/dev/null 2>&1 && die "write failure: a temporary folder was left behind"
done

for d in bad1 bad2 bad3 bad4 bad5 bad6 bad7 bad8 bad9 bad10 bad11 bad12 bad13 bad14; do
    [ -e "$W/$d" ] && die "$d: an output folder was left behind"
    ls -d "$W/$d".tmp-* >/dev/null 2>&1 && die "$d: a temporary folder was left behind"
done

# interruption: SIGINT during the run -> exit 3, no output folder, no temporary folder
"$B" quantize "$M" $CAL --hessian mlplocal-kfac --out "$W/intr" 2>"$W/intr.err" &
pid=$!
for _ in $(seq 1 100); do
    ls -d "$W/intr".tmp-* >/dev/null 2>&1 && break
    sleep 0.05
done
kill -INT $pid
wait $pid
rc=$?
[ $rc -eq 3 ] || die "interrupted run: exit $rc (expected 3): $(tail -1 "$W/intr.err")"
[ -e "$W/intr" ] && die "interrupted run left $W/intr"
ls -d "$W/intr".tmp-* >/dev/null 2>&1 && die "interrupted run left a temporary folder"
echo "interrupted run: exit $rc, nothing left behind"

exit $fail
