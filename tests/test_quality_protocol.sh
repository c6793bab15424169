#!/usr/bin/env bash
# scripts/quality_protocol.py with more than one evaluation file (issue 16):
# every quantized model is evaluated on every --eval file, a table each; the
# results equal `bakron eval` of the kept checkpoint; a rerun runs nothing; a
# folder of the one-file layout (no eval-files.json) keeps its results and gets
# the new file from re-made checkpoints, which reproduce the stored perplexities
# (the CPU quantize is deterministic); a wrong first file for such a folder and
# the same tokens twice are refused. Example model, 2 draws x 2 variants of 8
# calibration sequences, small evaluation files (16 x 256 and 4 x 1021 tokens).
set -u
python3 -c "import numpy, safetensors" 2>/dev/null || { echo "numpy/safetensors not installed: skipped"; exit 77; }
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
cd "$W" || exit 1

# E1: 16 evaluation windows of 256 tokens; E2: 4 windows of 1 + 4 x 255 tokens
# (BOS, then the bodies of 4 evaluation windows: not contiguous text, a longer
# file for the mechanics only)
python3 - "$M/eval.safetensors" <<'EOF' || exit 1
import sys
import numpy as np
from safetensors.numpy import load_file, save_file
x = load_file(sys.argv[1])["input_ids"]
save_file({"input_ids": np.ascontiguousarray(x[:16])}, "e1.safetensors")
rows = [np.concatenate([[1]] + [x[4 * i + k][1:] for k in range(4)]) for i in range(4)]
save_file({"input_ids": np.asarray(rows, dtype=np.int32)}, "e2.safetensors")
EOF

qp() { # OUT args... (output in OUT.log)
    local out=$1; shift
    python3 "$SRC/scripts/quality_protocol.py" --bakron "$B" --model "$M" --pool "$M/calib.safetensors" \
        --samples 8 --draws 2 --variants gptq,mlplocal-kfac --out "$out" "$@" -- --levels 3 >"$out.log" 2>&1
}
js() { python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print($2)" "$1"; }

# two files in one run, checkpoints kept
qp two --eval e1.safetensors --eval e2.safetensors --keep --jobs 2 || { cat two.log; die "two files: failed"; }
[ "$(grep -cE '^\| (gptq|mlplocal-kfac) \|' two/summary.md)" = 4 ] || die "two files: expected two tables of 2 variants"
[ "$(js two/summary.json 'len(s["evals"])')" = 2 ] || die "two files: summary.json evals"
[ -f two/evals/e2/eval-1-mlplocal-kfac.json ] || die "two files: no evals/e2/eval-1-mlplocal-kfac.json"
direct=$("$B" eval two/q-1-mlplocal-kfac --tokens e2.safetensors --json | python3 -c 'import json,sys; print(repr(json.load(sys.stdin)["perplexity"]))')
[ "$(js two/summary.json 'repr(s["evals"][1]["per_draw"]["1"]["mlplocal-kfac"])')" = "$direct" ] ||
    die "two files: draw 1 mlplocal-kfac on e2 is not bakron eval's $direct"
[ "$(js two/summary.json 's["eval"] == s["evals"][0]["eval"] and s["per_draw"] == s["evals"][0]["per_draw"]')" = True ] ||
    die "two files: top-level fields are not the first file's"

# a rerun runs nothing
qp two --eval e1.safetensors --eval e2.safetensors --keep || die "rerun failed"
! grep -q '^draw ' two.log || die "rerun: ran again: $(grep '^draw ' two.log)"

# the order on the command line only orders the tables
qp two --eval e2.safetensors --eval e1.safetensors --report-only || die "report-only failed"
[ "$(js two/summary.json 's["eval"]')" = e2.safetensors ] || die "report-only: first table not e2"
[ "$(js two/summary.json 's["evals"][1]["results"]')" = . ] || die "report-only: e1's results moved"

# a folder of the one-file layout: results of e1, no eval-files.json
qp old --eval e1.safetensors || die "one file: failed"
rm old/eval-files.json
cp -r old wrong
if qp wrong --eval e2.safetensors --eval e1.safetensors || ! grep -q "give that file first" wrong.log; then
    die "one-file folder, wrong first --eval: not refused"
fi
cp old/eval-0-gptq.json keep.json
qp old --eval e1.safetensors --eval e2.safetensors || { cat old.log; die "one-file folder + e2: failed"; }
cmp -s keep.json old/eval-0-gptq.json || die "one-file folder: the stored result was rewritten"
[ "$(cat old/recheck-*.txt | grep -c '^identical ')" = 4 ] || die "one-file folder: rechecks $(cat old/recheck-*.txt)"
# (two/summary.json is of the swapped report-only run: e2 first)
[ "$(js old/summary.json '[e["per_draw"] for e in s["evals"]]')" = "$(js two/summary.json '[e["per_draw"] for e in s["evals"]][::-1]')" ] ||
    die "one-file folder + e2: per-draw perplexities differ from the two-file run's"

# the same tokens twice
cp e1.safetensors e1copy.safetensors
if qp two --eval e1.safetensors --eval e1copy.safetensors --report-only ||
    ! grep -q "the same tokens as an earlier --eval" two.log; then
    die "same tokens twice: not refused"
fi

if [ $fail = 0 ]; then echo "1 passed, 0 failed"; else echo "0 passed, 1 failed"; fi
exit $fail
