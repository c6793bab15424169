#!/usr/bin/env bash
# Activation dumps carry and are checked for their identity (issue 14, points 5
# and 9; docs/activations.md "Checks"): swapped or redirected layer files, a
# dump of another model (config or weights) and a file of another calibration
# are refused with exit 2 and one line naming the file and what differs, before
# any layer is quantized; a .zst whose frame declares a huge size is refused
# from the manifest's shapes without allocating it; version 1 dumps still read.
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
cd "$W" || exit 1

dump() { # out args...
    local out=$1; shift
    "$B" dump-activations "$M" --calib "$M/calib.safetensors" --samples 2 --seqlen 64 \
        --out "$out" "$@" >/dev/null 2>"$W/err" || { echo "dump $out failed: $(cat "$W/err")"; exit 1; }
}
dump a
dump z --zstd

# expect_bad NAME DUMP PATTERN [MODEL]: quantize from DUMP gives exit 2, one
# line matching PATTERN, no layer started, no output folder
expect_bad() {
    local name=$1 d=$2 pat=$3 model=${4:-$M}
    rm -rf "$W/out"
    "$B" quantize "$model" --activations "$d" --hessian gptq --out "$W/out" >"$W/log" 2>"$W/err"
    local rc=$?
    [ $rc -eq 2 ] || die "$name: exit $rc, expected 2 ($(cat "$W/err"))"
    [ "$(wc -l <"$W/err")" -eq 1 ] || die "$name: not one line: $(cat "$W/err")"
    grep -qE -- "$pat" "$W/err" || die "$name: message does not match '$pat': $(cat "$W/err")"
    grep -q "layer 1/" "$W/log" "$W/err" && die "$name: a layer was started"
    [ -e "$W/out" ] && die "$name: output folder left"
    echo "refused ($name): $(cut -c1-200 "$W/err")"
}
good() { # name dump [model]
    rm -rf "$W/out"
    "$B" quantize "${3:-$M}" --activations "$2" --hessian gptq --out "$W/out" >"$W/log" 2>"$W/err" ||
        die "$1: exit $? ($(tail -1 "$W/err"))"
}

good "plain dump" a
cp out/model.safetensors ref.safetensors
good "zstd dump" z
cmp -s out/model.safetensors ref.safetensors || die "zstd dump: output differs from the plain dump's"

# --- the issue's probes: two layers' files swapped, a layer pointed at another's
cp -r a swap && mv swap/layer.0000.safetensors t && mv swap/layer.0001.safetensors swap/layer.0000.safetensors &&
    mv t swap/layer.0001.safetensors
expect_bad "swapped files" swap "layer\.0000\.safetensors: holds the activations of layer 1, but the manifest lists it as layer 0"
cp -r a redirect
python3 - redirect/manifest.json <<'EOF'
import json, sys
p = sys.argv[1]; m = json.load(open(p))
m["files"][1] = m["files"][0]
json.dump(m, open(p, "w"))
EOF
expect_bad "redirected layer" redirect "layer\.0000\.safetensors: holds the activations of layer 0, but the manifest lists it as layer 1"
cp -r z zswap && mv zswap/layer.0002.safetensors.zst t && mv zswap/layer.0003.safetensors.zst zswap/layer.0002.safetensors.zst &&
    mv t zswap/layer.0003.safetensors.zst
expect_bad "swapped .zst files" zswap "layer\.0002\.safetensors\.zst: holds the activations of layer 3"

# --- another model: the same architecture with one weight changed, or another config.json
cp -r "$M" m2
python3 - m2/model.safetensors <<'EOF'
import json, struct, sys
p = sys.argv[1]; b = bytearray(open(p, "rb").read())
n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
t = h["model.layers.2.mlp.up_proj.weight"]; o = 8 + n + t["data_offsets"][0]
b[o] ^= 1   # a fine-tune in one weight: the lowest mantissa bit of its first element (LE)
open(p, "wb").write(b)
EOF
expect_bad "dump of another model (weights)" a "manifest\.json: dumped from another model: the weights differ" m2
cp -r "$M" m3
python3 - m3/config.json <<'EOF'
import json, sys
p = sys.argv[1]; c = json.load(open(p)); c["rms_norm_eps"] = c.get("rms_norm_eps", 1e-5) * 2
json.dump(c, open(p, "w"), indent=1)
EOF
expect_bad "dump of another model (config)" a "manifest\.json: dumped from another model: config\.json differs" m3

# --- one layer file of another calibration (same shapes, other tokens)
"$B" dump-activations "$M" --calib "$M/eval.safetensors" --samples 2 --seqlen 64 --out other >/dev/null 2>&1 ||
    die "dump of eval.safetensors"
cp -r a mixed && cp other/layer.0002.safetensors mixed/
expect_bad "file of another calibration" mixed "layer\.0002\.safetensors: made from other calibration tokens"
# a file of a dump of the other model, put into this one
"$B" dump-activations m2 --calib "$M/calib.safetensors" --samples 2 --seqlen 64 --out a2 >/dev/null 2>&1 ||
    die "dump of m2"
cp -r a mixed2 && cp a2/layer.0001.safetensors mixed2/
expect_bad "file of another model's dump" mixed2 "layer\.0001\.safetensors: made from another model \(its weights differ\)"

# --- point 9: a tiny .zst whose frame declares 60 GiB -----------------------
cp -r z huge
python3 - huge/layer.0001.safetensors.zst a/layer.0001.safetensors <<'EOF'
import struct, sys
out, plain = sys.argv[1], sys.argv[2]
body = open(plain, "rb").read()[:4096]           # the real header and a little data
frame = b"\x28\xb5\x2f\xfd"                      # zstd magic
frame += bytes([0xC0])                           # 8-byte content size, not single-segment
frame += bytes([10 << 3])                        # window 1 MiB
frame += struct.pack("<Q", 60 << 30)             # declares 60 GiB
frame += struct.pack("<I", 1 | (len(body) << 3))[:3] + body  # one raw, last block
open(out, "wb").write(frame)
EOF
[ "$(stat -c %s huge/layer.0001.safetensors.zst)" -lt 5000 ] || die "huge: probe not tiny"
expect_bad "tiny .zst declaring 60 GiB" huge "layer\.0001\.safetensors\.zst: the zstd frame declares 64424509440 decompressed bytes, more than the [0-9]+ bytes allowed by the manifest's shapes"

# --- version 1 dumps (no digests) still read; their layer index still checked
cp -r a v1
python3 - v1/manifest.json <<'EOF'
import json, sys
p = sys.argv[1]; m = json.load(open(p))
m["version"] = 1
for k in ("config_sha256", "weights_sha256"): del m["model"][k]
del m["calibration_sha256"]
json.dump(m, open(p, "w"))
EOF
good "version 1 dump" v1
cmp -s out/model.safetensors ref.safetensors || die "version 1 dump: output differs"
grep -q "version 1: no model or calibration digests" "$W/log" "$W/err" || die "version 1 dump: no note"
cp -r v1 v1swap && mv v1swap/layer.0000.safetensors t && mv v1swap/layer.0003.safetensors v1swap/layer.0000.safetensors &&
    mv t v1swap/layer.0003.safetensors
expect_bad "version 1, swapped" v1swap "layer\.0000\.safetensors: holds the activations of layer 3"
# a version 2 manifest without its digests is refused, not read as version 1
cp -r a nodig
python3 - nodig/manifest.json <<'EOF'
import json, sys
p = sys.argv[1]; m = json.load(open(p)); del m["calibration_sha256"]; json.dump(m, open(p, "w"))
EOF
expect_bad "version 2 without digests" nodig "manifest\.json: .*calibration_sha256 missing"

[ $fail -eq 0 ] && echo "all activation-dump checks passed"
exit $fail
