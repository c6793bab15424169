#!/usr/bin/env bash
# scripts/dump_activations.py writes version 2 activation dumps (issue 14):
# its plain-Python digests and writer (everything but the transformers forward
# pass, which needs torch: tests/test_dump_agreement.sh) are fed the
# activations of a `bakron dump-activations` dump, and
#  - the manifest's config_sha256, weights_sha256 and calibration_sha256 equal
#    the ones bakron computed (src/digest.c) for the same model and tokens;
#  - `quantize --activations` reads the dump as version 2 (no "version 1"
#    note) and gives the same checkpoint as from bakron's own dump;
#  - a layer file of a dump of other tokens is refused (exit 2) by the
#    per-file digests the script writes.
# Needs only python3 (skipped, 77, without it).
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
command -v python3 >/dev/null || { echo "python3 not installed: skipped"; exit 77; }
cd "$W" || exit 1

"$B" dump-activations "$M" --calib "$M/calib.safetensors" --samples 4 --seqlen 64 --dtype f32 \
    --out native >/dev/null 2>err || { echo "FAIL: dump-activations: $(tail -1 err)"; exit 1; }

# pydump TOKENS OUT: the script's writer over native's activations, its digests
# computed from MODEL and the first 4 x 64 tokens of TOKENS
pydump() {
    python3 - "$SRC/scripts/dump_activations.py" "$M" native "$1" "$2" <<'EOF'
import importlib.util, json, os, sys
script, model, native, tokens, out = sys.argv[1:]
spec = importlib.util.spec_from_file_location("dump_activations", script)
d = importlib.util.module_from_spec(spec)
spec.loader.exec_module(d)
man = json.load(open(os.path.join(native, "manifest.json")))

def layer_tensors(l):
    path = os.path.join(native, man["files"][l])
    head, base = d.st_header(path)
    raw = open(path, "rb").read()
    return {k: (head[k]["shape"], raw[base + head[k]["data_offsets"][0]:base + head[k]["data_offsets"][1]])
            for k in d.ACTS}

info = {k: v for k, v in man["model"].items() if not k.endswith("_sha256")}
ids = d.load_tokens(tokens, 4, 64)
d.write_dump(out, model, tokens, ids, info, man["dtype"], layer_tensors, "tests/test_dump_activations_py.sh")
EOF
}
pydump "$M/calib.safetensors" py || { echo "FAIL: the script's writer failed"; exit 1; }

python3 - native/manifest.json py/manifest.json <<'EOF' || die "manifests differ (above)"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
bad = 0
for where, x, y in (("", a, b), ("model.", a["model"], b["model"])):
    for k in ("config_sha256", "weights_sha256", "calibration_sha256"):
        if k in x or k in y:
            ok = x.get(k) == y.get(k)
            print(("ok" if ok else "DIFFERS") + f": {where}{k} bakron {x.get(k)} script {y.get(k)}")
            bad += not ok
if b.get("version") != 2:
    print(f"version {b.get('version')}, expected 2"); bad += 1
sys.exit(1 if bad else 0)
EOF

Q=(quantize "$M" --hessian gptq --backend cpu --bits 4)
"$B" "${Q[@]}" --activations native --out qn >/dev/null 2>qn.err || die "quantize from bakron's dump: $(tail -1 qn.err)"
"$B" "${Q[@]}" --activations py --out qp >/dev/null 2>qp.err || die "quantize from the script's dump: $(tail -1 qp.err)"
grep -qi "version 1" qp.err && die "the script's dump was read as version 1: $(grep -i 'version 1' qp.err)"
cmp -s qn/model.safetensors qp/model.safetensors ||
    die "quantize from the script's dump gives another checkpoint than from bakron's"
[ $fail -eq 0 ] && echo "ok: quantize --activations reads the script's dump as version 2, same checkpoint"

# a layer file of a dump of other tokens: refused by the digests it carries
pydump "$M/eval.safetensors" other || die "the script's writer failed (other tokens)"
cp -r py mixed && cp other/layer.0002.safetensors mixed/
"$B" "${Q[@]}" --activations mixed --out qm >/dev/null 2>qm.err
rc=$?
[ $rc -eq 2 ] || die "a layer file of other tokens: exit $rc, expected 2 ($(tail -1 qm.err))"
grep -q "layer\.0002\.safetensors.*other calibration tokens" qm.err ||
    die "a layer file of other tokens: message does not name the file and the calibration: $(tail -1 qm.err)"
[ -e qm ] && die "an output folder was left"
[ $rc -eq 2 ] && echo "ok: $(tail -1 qm.err | cut -c1-200)"

[ $fail -eq 0 ] && echo "scripts/dump_activations.py writes version 2 dumps bakron accepts"
exit $fail
