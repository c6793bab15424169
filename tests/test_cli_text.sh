#!/usr/bin/env bash
# CLI test for plain-text calibration (run by meson as test 'cli_text').
#
# 1. `bakron quantize examples/kerneldocs-1.6m --calib-text DIR --hessian
#    mlplocal-kfac` works and writes the same model.safetensors, byte for
#    byte, as `--calib` with the token file that scripts/tokenize.py made from
#    the same text (tests/data/tokenizer/textcalib-kerneldocs.safetensors).
# 2. `bakron eval --text` gives the same perplexity as `eval --tokens` on
#    that file, on the source model and on the quantized output (which
#    carries the tokenizer.json).
# 3. --samples / --seqlen with text; a single file as input.
# 4. Mistakes: a model without tokenizer.json, an unsupported tokenizer.json,
#    a missing text path, text too short for one window: exit 2 with one line
#    naming the file; --calib-text with --calib: refused.
set -u

: "${BK_BAKRON:?BK_BAKRON must point to the bakron executable}"
: "${BK_TEST_DATA:?BK_TEST_DATA must point to tests/data}"
: "${BK_SOURCE_ROOT:?BK_SOURCE_ROOT must point to the source tree}"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/bk_cli_text.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
failures=0
checks=0
model="$BK_SOURCE_ROOT/examples/kerneldocs-1.6m"
text="$BK_TEST_DATA/tokenizer/textcalib"
ref="$BK_TEST_DATA/tokenizer/textcalib-kerneldocs.safetensors"

fail() {
    echo "FAIL: $*" >&2
    failures=$((failures + 1))
}

run() {
    "$BK_BAKRON" "$@" >"$tmp/out" 2>"$tmp/err"
    rc=$?
    checks=$((checks + 1))
}

expect_rc() {
    if [ "$rc" != "$1" ]; then
        fail "$label: exit $rc, expected $1"
        sed 's/^/    | /' "$tmp/err" | tail -5 >&2
    fi
}

# expect_one_line REGEX: stderr is exactly one line and matches
expect_one_line() {
    local n
    n=$(wc -l <"$tmp/err")
    if [ "$n" != 1 ] || ! grep -Eq -- "$1" "$tmp/err"; then
        fail "$label: expected one line matching '$1' on stderr, got $n:"
        sed 's/^/    | /' "$tmp/err" | head -5 >&2
    fi
}

# 1. text == token file made by the Python path
label="quantize --calib-text"
run quantize "$model" --calib-text "$text" --seqlen 64 --hessian mlplocal-kfac --backend cpu \
    --out "$tmp/qt"
expect_rc 0
label="quantize --calib (tokenize.py's file)"
run quantize "$model" --calib "$ref" --hessian mlplocal-kfac --backend cpu --out "$tmp/qc"
expect_rc 0
if [ -f "$tmp/qt/model.safetensors" ] && [ -f "$tmp/qc/model.safetensors" ]; then
    cmp -s "$tmp/qt/model.safetensors" "$tmp/qc/model.safetensors" ||
        fail "--calib-text and --calib with tokenize.py's windows give different models"
    checks=$((checks + 1))
    [ -f "$tmp/qt/tokenizer.json" ] || fail "the quantized output has no tokenizer.json"
    python3 - "$tmp/qt/report.json" <<'EOF' || fail "report.json does not record the text calibration"
import json, sys
r = json.load(open(sys.argv[1]))
def find(x):
    if isinstance(x, dict):
        if "calibration" in x:
            return x["calibration"]
        for v in x.values():
            c = find(v)
            if c:
                return c
cal = find(r)
sys.exit(0 if cal and cal.get("text", "").endswith("textcalib") and cal["sequences"] == 30 and cal["seqlen"] == 64 else 1)
EOF
fi

# the design card's command as written (default --seqlen: 1024, the model's context)
cat "$text/a.txt" "$text/c.txt" "$text/sub/b.md" "$text/a.txt" >"$tmp/some.txt"
label="quantize examples/kerneldocs-1.6m --calib-text some.txt --hessian mlplocal-kfac --out q/"
(cd "$tmp" && "$BK_BAKRON" quantize "$model" --calib-text some.txt --hessian mlplocal-kfac \
    --backend cpu --out q/ >"$tmp/out" 2>"$tmp/err")
rc=$?
checks=$((checks + 1))
expect_rc 0
[ -f "$tmp/q/model.safetensors" ] || fail "$label: no model.safetensors"

# 2. eval --text == eval --tokens
for m in "$model" "$tmp/qt"; do
    label="eval --text on $(basename "$m")"
    run eval "$m" --text "$text" --seqlen 64 --backend cpu
    expect_rc 0
    grep '^perplexity' "$tmp/out" >"$tmp/ppl_text"
    run eval "$m" --tokens "$ref" --backend cpu
    expect_rc 0
    grep '^perplexity' "$tmp/out" >"$tmp/ppl_tokens"
    if ! [ -s "$tmp/ppl_text" ] || ! cmp -s "$tmp/ppl_text" "$tmp/ppl_tokens"; then
        fail "$label: '$(cat "$tmp/ppl_text")' vs --tokens '$(cat "$tmp/ppl_tokens")'"
    fi
done

# 3. --samples, one file
label="eval --text FILE --samples 3"
run eval "$model" --text "$text/a.txt" --seqlen 32 --samples 3 --json --backend cpu
expect_rc 0
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d["sequences"]==3 and d["seqlen"]==32 else 1)' \
    "$tmp/out" || fail "$label: expected 3 sequences of 32 tokens"

# 4. mistakes
mkdir -p "$tmp/notok"
cp "$model/config.json" "$model/model.safetensors" "$tmp/notok/"
label="model without tokenizer.json"
run quantize "$tmp/notok" --calib-text "$text" --hessian gptq --out "$tmp/q1"
expect_rc 2
expect_one_line "notok/tokenizer.json: not found.*--calib"
[ -e "$tmp/q1" ] && fail "$label: output folder left behind"
run eval "$tmp/notok" --text "$text"
expect_rc 2
expect_one_line "notok/tokenizer.json: not found.*--calib"

mkdir -p "$tmp/unigram"
cp "$model/config.json" "$model/model.safetensors" "$tmp/unigram/"
printf '{"model": {"type": "Unigram", "unk_id": 0, "vocab": [["<unk>", 0.0]]}}\n' >"$tmp/unigram/tokenizer.json"
label="Unigram tokenizer.json"
run quantize "$tmp/unigram" --calib-text "$text" --hessian gptq --out "$tmp/q2"
expect_rc 2
expect_one_line "unigram/tokenizer.json: model type 'Unigram' is not supported"

label="missing text"
run quantize "$model" --calib-text "$tmp/nothing-here" --hessian gptq --out "$tmp/q3"
expect_rc 2
expect_one_line "nothing-here: no such file or folder"

label="text too short"
run eval "$model" --text "$text/sub/b.md" --seqlen 1000
expect_rc 2
expect_one_line "b.md: .* not enough for one window of 1000"

label="--calib-text with --calib"
run quantize "$model" --calib-text "$text" --calib "$ref" --hessian gptq --out "$tmp/q4"
[ "$rc" != 0 ] || fail "$label: accepted"
label="eval --text with --tokens"
run eval "$model" --text "$text" --tokens "$ref"
expect_rc 1

echo "$((checks - failures)) passed, $failures failed"
[ "$failures" = 0 ]
