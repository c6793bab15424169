#!/usr/bin/env bash
# bakron merge (issue 18): layer-range runs from one activation dump, merged,
# are byte-identical to one full run (every file but report.json, whose
# time-free fields must match too) for the three exports and with sharding;
# overlapping or missing ranges, different settings, activations or model,
# and parts made from --calib with the sequential flow are refused with one
# line, exit 2, and no output folder.
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
cd "$W" || exit 1

"$B" dump-activations "$M" --calib "$M/calib.safetensors" --samples 8 --backend cpu \
    --out acts 2>/dev/null || { echo "FAIL: dump-activations"; exit 1; }
"$B" dump-activations "$M" --calib "$M/calib.safetensors" --samples 6 --backend cpu \
    --out acts6 2>/dev/null || { echo "FAIL: dump-activations (6)"; exit 1; }

# report.json without times (the rule of scripts/output_hashes.sh)
strip_report() {
    python3 -c '
import json,sys
r=json.load(open(sys.argv[1]))
def strip(x):
    if isinstance(x,dict):
        return {k:strip(v) for k,v in x.items() if not (k.startswith("t_") or k.endswith("_s") or k in ("time","times","date","device","model_dir","out_dir","calib","calib_path","elapsed","stage_times","version","commit"))}
    if isinstance(x,list): return [strip(v) for v in x]
    return x
print(json.dumps(strip(r),sort_keys=True))' "$1"
}

same_output() { # what full merged
    local what=$1 a=$2 b=$3 f
    [ "$(ls "$a")" = "$(ls "$b")" ] || { die "$what: files differ: $(ls "$a" | tr '\n' ' ') vs $(ls "$b" | tr '\n' ' ')"; return; }
    for f in $(ls "$a"); do
        if [ "$f" = report.json ]; then
            [ "$(strip_report "$a/$f")" = "$(strip_report "$b/$f")" ] || die "$what: report.json differs (time-free fields)"
        else
            cmp -s "$a/$f" "$b/$f" || die "$what: $f differs from the full run's"
        fi
    done
    echo "ok: $what ($(ls "$a" | wc -l) files identical)"
}

q() { # out range args...
    local out=$1 range=$2; shift 2
    "$B" quantize "$M" --activations acts --backend cpu --layers "$range" --out "$out" "$@" \
        >/dev/null 2>"$W/err" || die "quantize $out $range: $(cat "$W/err")"
}

# --- byte identity ------------------------------------------------------------
for e in native dequantized gptq; do
    args=(--hessian mlplocal-kfac --export "$e" --levels 3)
    [ "$e" = gptq ] && args=(--hessian fullylocal-kfac --export gptq --bits 4 --group 64)
    q "full-$e" 0:4 "${args[@]}"
    q "a-$e" 0:1 "${args[@]}"
    q "b-$e" 1:3 "${args[@]}"
    q "c-$e" 3:4 "${args[@]}"
    # any order of the parts
    "$B" merge "c-$e" "a-$e" "b-$e" --out "m-$e" 2>"$W/err" || die "merge $e: $(cat "$W/err")"
    same_output "merge of 3 parts, $e" "full-$e" "m-$e"
done
# sharded outputs (the same --max-shard-size for the parts and the merge)
q full-sh 0:4 --hessian gptq --max-shard-size 300000
q a-sh 0:2 --hessian gptq --max-shard-size 300000
q b-sh 2:4 --hessian gptq --max-shard-size 300000
"$B" merge a-sh b-sh --out m-sh --max-shard-size 300000 2>"$W/err" || die "merge sharded: $(cat "$W/err")"
[ -f full-sh/model.safetensors.index.json ] || die "the sharded full run is not sharded"
same_output "merge, sharded" full-sh m-sh
# rtn without calibration: no activations needed
"$B" quantize "$M" --hessian rtn --layers 0:2 --out r1 2>/dev/null &&
    "$B" quantize "$M" --hessian rtn --layers 2:4 --out r2 2>/dev/null &&
    "$B" quantize "$M" --hessian rtn --out rfull 2>/dev/null || die "rtn runs"
"$B" merge r1 r2 --out rm 2>"$W/err" || die "merge rtn: $(cat "$W/err")"
same_output "merge, rtn" rfull rm

# --- refusals: exit 2, one line, nothing written ---------------------------------
refused() { # why expected-words parts...
    local why=$1 words=$2; shift 2
    "$B" merge "$@" --out refused 2>"$W/err" >/dev/null; local rc=$?
    [ $rc -eq 2 ] || die "$why: exit $rc, expected 2 ($(cat "$W/err"))"
    [ "$(wc -l <"$W/err")" -eq 1 ] || die "$why: not one line: $(cat "$W/err")"
    grep -q -- "$words" "$W/err" || die "$why: message lacks '$words': $(cat "$W/err")"
    ls -a | grep -q '^refused' && die "$why: left $(ls -a | grep refused | tr '\n' ' ')"
    ls -a | grep -q '^\.refused' && die "$why: left a lock"
    echo "refused ($why): $(cut -c1-160 "$W/err")"
}
q o-1-4 1:4 --hessian mlplocal-kfac --export native
refused "overlapping ranges" "overlaps" a-native b-native o-1-4
refused "missing layers in the middle" "layers 1:3 are missing" a-native c-native
refused "missing last layer" "layers 3:4 are missing" a-native b-native
refused "missing first layer" "layers 0:1 are missing" b-native c-native
refused "duplicate part" "overlaps" a-native a-native b-native c-native
q d-1-3 1:3 --hessian mlplocal-kfac --export native --damp 0.1
refused "different damping" "damp" a-native d-1-3 c-native
q h-1-3 1:3 --hessian gptq --export native
refused "different hessian" "hessian" a-native h-1-3 c-native
refused "different export" "differ" a-native b-dequantized c-native
"$B" quantize "$M" --activations acts6 --backend cpu --layers 1:3 --hessian mlplocal-kfac \
    --out s6 2>/dev/null || die "quantize acts6"
refused "different activations" "calibration" a-native s6 c-native
# another model: one value of model.norm.weight changed (the last tensor of the file)
cp -r "$M" m2
python3 -c '
import sys
p=sys.argv[1]; b=bytearray(open(p,"rb").read()); b[-2]^=1; open(p,"wb").write(b)' m2/model.safetensors
# (its own dump, under the same relative path: dumps name the model they came from)
mkdir other
(cd other && "$B" dump-activations ../m2 --calib "$M/calib.safetensors" --samples 8 \
    --backend cpu --out acts 2>/dev/null &&
    "$B" quantize ../m2 --activations acts --backend cpu --layers 1:3 --hessian mlplocal-kfac \
        --out ../om2 2>/dev/null) || die "quantize m2"
refused "different model" "model.norm.weight" a-native om2 c-native
"$B" quantize "$M" --calib "$M/calib.safetensors" --samples 8 --backend cpu --layers 1:4 \
    --hessian gptq --out seq 2>/dev/null || die "quantize --calib"
"$B" quantize "$M" --activations acts --backend cpu --layers 0:1 --hessian gptq \
    --out seq0 2>/dev/null || die "quantize 0:1"
refused "sequential --calib part" "sequential" seq0 seq
refused "not an output" "not a bakron quantize output" a-native acts
exit $fail
