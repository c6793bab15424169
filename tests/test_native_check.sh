#!/usr/bin/env bash
# The native quantized-checkpoint reader checks the codes and the quantization
# metadata against each other (docs/formats.md, "--export native"): quantize
# outputs of the example model (levels 3; uniform 4-bit asymmetric, group 32;
# uniform 8-bit symmetric) still load, and each is damaged one way at a time
# (config.json's quantization_config, or bytes of a tensor in place) and must
# be refused by `eval` and `inspect` with exit 2 and one line on stderr naming
# the file and the tensor (or config.json and the key) and the rule; codes
# outside the alphabet by `eval` (and merge) only: `inspect` reads no codes.
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
cd "$W" || exit 1

Q=(quantize "$M" --calib "$M/calib.safetensors" --samples 2 --backend cpu)
EV=(--tokens "$M/eval.safetensors" --samples 2 --backend cpu)
"$B" "${Q[@]}" --hessian gptq --levels 3 --out ql 2>q.err || { cat q.err; exit 1; }
"$B" "${Q[@]}" --hessian gptq --bits 4 --group 32 --asym --out qa 2>q.err || { cat q.err; exit 1; }
"$B" "${Q[@]}" --hessian rtn --bits 8 --out q8 2>q.err || { cat q.err; exit 1; }

# every valid output loads
for d in ql qa q8; do
    "$B" eval "$d" "${EV[@]}" >/dev/null 2>err || die "eval $d: $(tail -1 err)"
    "$B" inspect "$d" >/dev/null 2>err || die "inspect $d: $(tail -1 err)"
done

# cfg FOLDER PYTHON: edit FOLDER/config.json's quantization_config (as q)
cfg() {
    python3 - "$1/config.json" "$2" <<'EOF'
import json, sys
p, code = sys.argv[1:]
c = json.load(open(p))
q = c["quantization_config"]
exec(code)
json.dump(c, open(p, "w"), indent=2)
EOF
}
# poke FOLDER TENSOR INDEX FORMAT VALUE: element INDEX of TENSOR (in
# FOLDER/model.safetensors) set to VALUE, packed with struct FORMAT, in place
poke() {
    python3 - "$1/model.safetensors" "$2" "$3" "$4" "$5" <<'EOF'
import json, struct, sys
p, name, idx, fmt, val = sys.argv[1:]
b = bytearray(open(p, "rb").read())
n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
t = h[name]
o = 8 + n + t["data_offsets"][0] + int(idx) * struct.calcsize(fmt)
assert o + struct.calcsize(fmt) <= 8 + n + t["data_offsets"][1]
struct.pack_into("<" + fmt, b, o, float(val) if fmt in "fe" else int(val))
open(p, "wb").write(b)
EOF
}

# check NAME PATTERN [CMDS]: eval and inspect (or CMDS) of the damaged folder
# NAME exit 2 with exactly one line on stderr matching PATTERN
check() {
    local d=$1 pat=$2 cmd
    for cmd in ${3:-eval inspect}; do
        if [ $cmd = eval ]; then
            "$B" eval "$d" "${EV[@]}" >out 2>err
        else
            "$B" inspect "$d" >out 2>err
        fi
        local rc=$? lines
        lines=$(wc -l <err)
        [ $rc = 2 ] || die "$cmd $d: exit $rc, expected 2 ($(tail -1 err))"
        [ "$lines" = 1 ] || die "$cmd $d: $lines lines on stderr, expected 1: $(head -3 err)"
        grep -qE -- "$pat" err || die "$cmd $d: message does not match '$pat': $(cat err)"
    done
    echo "ok: $d: $(cut -c1-200 err)"
}
# inspect_reads_no_codes NAME: inspect looks at headers, metadata and scales
# only (fast on a model of many GB), so a bad code is eval's and merge's to find
inspect_reads_no_codes() {
    "$B" inspect "$1" >/dev/null 2>err || die "inspect $1: exit $?, expected 0 (it reads no codes): $(tail -1 err)"
}
# damage BASE NAME: a fresh copy NAME of the output BASE
damage() { rm -rf "$2" && cp -r "$1" "$2"; }

QW=model.layers.0.self_attn.q_proj
DW=model.layers.1.mlp.down_proj

# --- codes outside the alphabet
damage ql c1 && poke c1 $QW.qweight 5 b 100
check c1 "c1/model\.safetensors: tensor $QW\.qweight: code 100 at \[0, 5\] is outside the alphabet \(alphabet levels 3: codes -3\.\.3\)" eval
inspect_reads_no_codes c1
damage ql c2 && poke c2 $DW.qweight 77 b -4
check c2 "tensor $DW\.qweight: code -4 at \[[0-9]+, [0-9]+\] is outside the alphabet \(alphabet levels 3" eval
inspect_reads_no_codes c2
damage qa c3 && poke c3 $QW.qweight 0 B 16
check c3 "tensor $QW\.qweight: code 16 at \[0, 0\] is outside the alphabet \(alphabet uniform 4-bit asymmetric: codes 0\.\.15\)" eval
inspect_reads_no_codes c3
# the levels alphabet of a larger output read as levels 2: codes of 3 refused
damage ql c4 && cfg c4 'q["levels"] = 2' && poke c4 $QW.qweight 0 b 3
check c4 "tensor $QW\.qweight: code 3 at \[0, 0\] is outside the alphabet \(alphabet levels 2: codes -2\.\.2\)" eval
inspect_reads_no_codes c4

# --- the metadata
damage ql m1 && cfg m1 'q["levels"] = 0'
check m1 "m1/config\.json: quantization_config\.levels must be a whole number in \[1, 127\] .*got 0"
damage ql m2 && cfg m2 'q["levels"] = 1000'
check m2 "m2/config\.json: quantization_config\.levels must be a whole number in \[1, 127\] .*got 1000"
damage ql m3 && cfg m3 'q["levels"] = 2.5'
check m3 "m3/config\.json: quantization_config\.levels must be a whole number"
damage q8 m4 && cfg m4 'q["bits"] = 99'
check m4 "m4/config\.json: quantization_config\.bits must be 2, 3, 4 or 8"
damage ql m5 && cfg m5 'del q["alphabet"]'
check m5 "m5/config\.json: quantization_config\.alphabet is missing"
damage ql m6 && cfg m6 'del q["levels"]'
check m6 "m6/config\.json: quantization_config\.levels is missing"
damage q8 m7 && cfg m7 'del q["bits"]'
check m7 "m7/config\.json: quantization_config\.bits is missing"
damage ql m8 && cfg m8 'q["alphabet"] = "ternary"'
check m8 "m8/config\.json: quantization_config\.alphabet must be \"levels\" or \"uniform\""
damage q8 m9 && cfg m9 'del q["sym"]'
check m9 "m9/config\.json: quantization_config\.sym is missing"
# asymmetric U8 codes declared symmetric, and the other way round
damage qa m10 && cfg m10 'q["sym"] = True'
check m10 "tensor $QW\.qweight: expected I8 \[[0-9]+, [0-9]+\] codes \(alphabet uniform 4-bit symmetric"
damage q8 m11 && cfg m11 'q["sym"] = False'
check m11 "tensor $QW\.qweight: expected U8 \[[0-9]+, [0-9]+\] codes \(alphabet uniform 8-bit asymmetric"
damage ql m12 && cfg m12 'q["alphabet"] = "uniform"; q["bits"] = 2; del q["levels"]'
check m12 "tensor $QW\.qweight: code -3 at .* \(alphabet uniform 2-bit symmetric: codes -2\.\.1\)|tensor $QW\.qweight: code 3 at" eval
inspect_reads_no_codes m12
# the group counts: levels have one scale per row; a group size that does
# not give the scales' column count
damage ql g1 && cfg g1 'q["group_size"] = 32'
check g1 "g1/config\.json: quantization_config\.group_size must be -1 with alphabet \"levels\""
damage qa g2 && cfg g2 'q["group_size"] = 64'
check g2 "tensor $QW\.scales: expected float \[[0-9]+, [0-9]+\] scales \(group_size 64\)"
damage qa g3 && cfg g3 'q["group_size"] = -1'
check g3 "tensor $QW\.scales: expected float \[[0-9]+, 1\] scales \(group_size -1\)"

# --- scales and zero points
damage ql s1 && poke s1 $QW.scales 3 f nan
check s1 "s1/model\.safetensors: tensor $QW\.scales: scale nan at \[3, 0\] \(scales must be finite\)"
damage ql s2 && poke s2 $QW.scales 0 f inf
check s2 "tensor $QW\.scales: scale inf at \[0, 0\] \(scales must be finite\)"
damage ql s3 && poke s3 $DW.scales 1 f 0
check s3 "tensor $DW\.scales: scale 0 at \[1, 0\] \(native scales must be > 0\)"
damage qa s4 && poke s4 $QW.scales 1 f -0.5
check s4 "tensor $QW\.scales: scale -0\.5 at \[0, 1\] \(native scales must be > 0\)"
damage qa z1 && poke z1 $QW.qzeros 0 f nan
check z1 "tensor $QW\.qzeros: zero point nan at \[0, 0\] \(zero points must be finite\)"
damage qa z2 && poke z2 $QW.qzeros 2 f 16
check z2 "tensor $QW\.qzeros: zero point 16 at \[0, 2\] is outside the code range \[0, 15\]"

# --- merge reads its parts as eval does: metadata and scales when it opens
# them, the codes as it copies them; nothing is left under --out
"$B" quantize "$M" --hessian rtn --levels 3 --layers 0:2 --out r1 2>q.err &&
    "$B" quantize "$M" --hessian rtn --levels 3 --layers 2:4 --out r2 2>>q.err ||
    { cat q.err; exit 1; }
"$B" merge r1 r2 --out rm 2>err || die "merge of valid parts: $(cat err)"
L2=model.layers.2.self_attn.q_proj
# mergeck NAME PATTERN: merge r1 with the damaged part NAME: exit 2, one line
mergeck() {
    rm -rf mo
    "$B" merge r1 "$1" --out mo >out 2>err
    local rc=$? lines
    lines=$(grep -vc '^bakron: ' err)
    [ $rc = 2 ] || die "merge $1: exit $rc, expected 2 ($(tail -1 err))"
    [ "$lines" = 1 ] || die "merge $1: $lines error lines, expected 1: $(cat err)"
    grep -qE -- "$2" err || die "merge $1: message does not match '$2': $(cat err)"
    [ -e mo ] && die "merge $1: left an output"
    echo "ok: merge $1: $(grep -v '^bakron: ' err | cut -c1-200)"
}
damage r2 p1 && poke p1 $L2.qweight 7 b 100
mergeck p1 "p1/model\.safetensors: tensor $L2\.qweight: code 100 at \[0, 7\] is outside the alphabet"
damage r2 p2 && poke p2 $L2.scales 0 f 0
mergeck p2 "p2/model\.safetensors: tensor $L2\.scales: scale 0 at \[0, 0\]"
damage r2 p3 && cfg p3 'q["levels"] = 1000'
mergeck p3 "p3/config\.json: quantization_config\.levels must be a whole number"

# eval reports no perplexity for damaged codes (the error ends it)
rm -rf c1o && cp -r ql c1o && poke c1o $QW.qweight 0 b 100
"$B" eval c1o "${EV[@]}" --json >out 2>err
grep -q perplexity out && die "eval printed a perplexity for damaged codes"

exit $fail
