#!/usr/bin/env bash
# Error messages name what caused them (issue 14 point 12): a weight at the BF16
# maximum names the tensor and the first forward operation that overflowed; a
# rope_theta that underflows names config.json and rope_theta; an interrupt is
# numbered like the progress lines; control characters and invalid UTF-8 read
# from an input are escaped, never echoed raw.
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
cd "$W" || exit 1

# expect RC PATTERN CMD...: exit RC, one line on stderr matching PATTERN
expect() {
    local rc=$1 pat=$2; shift 2
    "$@" >"$W/out" 2>"$W/err"
    local got=$?
    [ $got -eq "$rc" ] || die "$*: exit $got, expected $rc ($(tail -1 "$W/err"))"
    local last
    last=$(grep -v '^  \|^layer \|^bakron: ' "$W/err" | tail -1)
    grep -qE -- "$pat" <<<"$last" || die "$*: message does not match '$pat': $last"
    echo "ok: $(cut -c1-220 <<<"$last")"
}

# --- a weight at the BF16 maximum (finite, so the start-up scan accepts it)
set_bf16_max() { # model tensor how (row0 | elem0)
    python3 - "$1/model.safetensors" "$2" "$3" <<'EOF'
import json, struct, sys
p, name, how = sys.argv[1:]
b = bytearray(open(p, "rb").read())
n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
t = h[name]; assert t["dtype"] == "BF16", t["dtype"]
o = 8 + n + t["data_offsets"][0]
cols = t["shape"][-1] if how == "row0" else 1
for k in range(cols):
    struct.pack_into("<H", b, o + 2 * k, 0x7F7F)   # 3.3895e38, the largest finite BF16
open(p, "wb").write(b)
EOF
}
Q=(quantize --calib "$M/calib.safetensors" --samples 2 --hessian gptq --backend cpu)
cp -r "$M" m1 && set_bf16_max m1 model.layers.0.self_attn.v_proj.weight row0
expect 2 "layer 0 v_proj output: non-finite value .*: the float32 forward pass overflowed here; the largest weight feeding it is model\.layers\.0\.self_attn\.v_proj\.weight = 3\.3895[0-9]*e\+38" \
    "$B" "${Q[@]}" m1 --out o1
cp -r "$M" m2 && set_bf16_max m2 model.layers.1.post_attention_layernorm.weight elem0
expect 2 "layer 1 gate/up_proj input \(post_attention_layernorm\): non-finite value .* model\.layers\.1\.post_attention_layernorm\.weight = 3\.3895[0-9]*e\+38 \(element 0\)" \
    "$B" "${Q[@]}" m2 --out o2
[ -e o1 ] || [ -e o2 ] && die "an output folder was left"

# --- rope_theta that underflows: config.json and the field, before any work
cp -r "$M" m3
python3 - m3/config.json <<'EOF'
import json, sys
p = sys.argv[1]; c = json.load(open(p))
if "rope_parameters" in c: c["rope_parameters"]["rope_theta"] = 1e-50
else: c["rope_theta"] = 1e-50
json.dump(c, open(p, "w"))
EOF
expect 2 "m3/config\.json: rope_theta = 1e-50 makes a RoPE frequency non-finite" "$B" "${Q[@]}" m3 --out o3

# --- a calibration token .zst whose zstd frame declares more than the file's
# own safetensors header allows (issue 14 point 9): bad input, before any work
python3 - "$M/calib.safetensors" <<'EOF'
import struct, sys
img = open(sys.argv[1], "rb").read()
def frame(declared, body, rle):     # raw blocks with body, then rle RLE blocks of 128 KiB zeros
    f = b"\x28\xb5\x2f\xfd" + bytes([0xC0, 10 << 3]) + struct.pack("<Q", declared)
    blocks = [(0, len(body[i:i + 65536]), body[i:i + 65536]) for i in range(0, len(body), 65536)]
    blocks += [(1, 1 << 17, b"\0")] * rle
    for i, (kind, size, data) in enumerate(blocks):
        last = 1 if i == len(blocks) - 1 else 0
        f += struct.pack("<I", last | kind << 1 | size << 3)[:3] + data
    return f
open("honest.safetensors.zst", "wb").write(frame(len(img), img, 0))
open("shapes.safetensors.zst", "wb").write(frame(len(img) + (16 << 17), img, 16))
open("huge.safetensors.zst", "wb").write(frame(60 << 30, img, 0))
EOF
"$B" inspect honest.safetensors.zst >/dev/null 2>err || die "the honest token .zst does not read: $(cat err)"
n=$(stat -c %s "$M/calib.safetensors")
expect 2 "shapes\.safetensors\.zst: the zstd frame declares $((n + (16 << 17))) decompressed bytes, more than the $n bytes allowed by the safetensors header's shapes" \
    "$B" quantize "${Q[@]:3}" --calib shapes.safetensors.zst "$M" --out o5
expect 2 "huge\.safetensors\.zst: truncated or corrupt zstd stream \(the frame declares 64424509440 decompressed bytes; [0-9]+ compressed bytes hold at most" \
    "$B" quantize "${Q[@]:3}" --calib huge.safetensors.zst "$M" --out o5
expect 2 "shapes\.safetensors\.zst: the zstd frame declares" "$B" inspect shapes.safetensors.zst
[ -e o5 ] && die "an output folder was left"

# --- control characters and invalid UTF-8 from an input file are escaped
printf '{"model_type": "gpt\\u001b[31m\xff", "hidden_size": 8}' >esc.json
"$B" inspect esc.json >/dev/null 2>err; rc=$?
[ $rc -eq 2 ] || die "inspect esc.json: exit $rc"
grep -q 'gpt\\x1b\[31m\\xff' err || die "escaped model_type not in the message: $(cat -v err)"
LC_ALL=C grep -q $'\x1b' err && die "a raw ESC byte reached stderr"
LC_ALL=C grep -q $'\xff' err && die "a raw 0xff byte reached stderr"
echo "ok: $(cat err)"

# --- an interrupt is numbered like the progress lines: "layer L (k/n)"
"$B" quantize "$M" --calib "$M/calib.safetensors" --samples 16 --hessian gptq --backend cpu \
    --out o4 >/dev/null 2>int.err &
pid=$!
for _ in $(seq 1200); do
    grep -q "done (1/4)" int.err 2>/dev/null && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.02
done
kill -INT $pid 2>/dev/null
wait $pid; rc=$?
if grep -q "interrupted" int.err; then
    [ $rc -eq 3 ] || die "interrupt: exit $rc"
    msg=$(grep "interrupted" int.err | tail -1)
    L=$(sed -nE 's/.*interrupted (after|at) layer ([0-9]+) \(([0-9]+)\/4\).*/\2 \3/p' <<<"$msg")
    [ -n "$L" ] || die "interrupt message not numbered 'layer L (k/4)': $msg"
    set -- $L
    [ "$2" -eq $(($1 + 1)) ] || die "interrupt message '$msg': k is not layer + 1 with all layers selected"
    grep -qE "^(  )?layer $1 (done )?\($2/4\)" int.err ||
        die "no progress line numbered 'layer $1 ($2/4)' before the interrupt '$msg'"
    echo "ok: $msg (progress: $(grep -E "^(  )?layer $1 (done )?\($2/4\)" int.err | tail -1 | cut -c1-60))"
else
    echo "interrupt: the run ended before the signal (exit $rc); numbering not checked this time"
fi

# --- a config.json that is there but not a file is named as what it is (not "no config.json")
cp -r "$M" mcf && rm mcf/config.json && mkfifo mcf/config.json
expect 2 "mcf/config\.json: is a FIFO \(named pipe\), not a regular file" \
    "$B" eval mcf --tokens "$M/eval.safetensors" --samples 2 --backend cpu
rm mcf/config.json && mkdir mcf/config.json
expect 2 "mcf/config\.json: is a folder, not a regular file" \
    "$B" quantize mcf --calib "$M/calib.safetensors" --samples 2 --out o6
rm -rf mcf

# --- a hangup under nohup is ignored (SIGHUP set to be ignored stays ignored);
# without nohup it interrupts like SIGINT (exit 3)
for how in nohup plain; do
    rm -rf o5
    pre=(); [ $how = nohup ] && pre=(nohup)
    "${pre[@]}" "$B" quantize "$M" --calib "$M/calib.safetensors" --samples 16 --hessian gptq \
        --backend cpu --out o5 >/dev/null 2>hup.err &
    pid=$!
    for _ in $(seq 1200); do
        grep -q "done (1/4)" hup.err 2>/dev/null && break
        kill -0 $pid 2>/dev/null || break
        sleep 0.02
    done
    if kill -HUP $pid 2>/dev/null; then
        wait $pid; rc=$?
        if [ $how = nohup ]; then
            [ $rc -eq 0 ] && [ -f o5/model.safetensors ] ||
                die "nohup: a hangup stopped the run (exit $rc): $(tail -1 hup.err)"
        else
            [ $rc -eq 3 ] && grep -q "interrupted" hup.err ||
                die "SIGHUP: exit $rc, expected 3 and an interrupt message: $(tail -1 hup.err)"
        fi
        echo "SIGHUP ($how): exit $rc, $(tail -1 hup.err | cut -c1-100)"
    else
        wait $pid
        echo "SIGHUP ($how): the run ended before the signal; not checked this time"
    fi
done

[ $fail -eq 0 ] && echo "all message checks passed"
exit $fail
