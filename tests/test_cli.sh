#!/usr/bin/env bash
# CLI test for `bakron inspect` (run by meson as test 'cli_inspect').
#
# 1. Every model in tests/data/models/ and the bundled example: exit 0, the
#    key lines with values typed in from the config files and the
#    checkpoints (counted independently), and --json is one valid JSON
#    document with the same numbers.
# 2. A lone .safetensors file, an index.json and a config.json.
# 3. Usage errors exit 1.
# 4. Every malformed file or folder under tests/data/bad/*/ exits 2 with
#    exactly one line on stderr and nothing on stdout.
set -u

: "${BK_BAKRON:?BK_BAKRON must point to the bakron executable}"
: "${BK_TEST_DATA:?BK_TEST_DATA must point to tests/data}"
: "${BK_SOURCE_ROOT:?BK_SOURCE_ROOT must point to the source tree}"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/bk_cli_inspect.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
failures=0
checks=0

fail() {
    echo "FAIL: $*" >&2
    failures=$((failures + 1))
}

# run ARGS...: runs bakron, leaves stdout/stderr in $tmp/out, $tmp/err, rc in $rc
run() {
    "$BK_BAKRON" "$@" >"$tmp/out" 2>"$tmp/err"
    rc=$?
    checks=$((checks + 1))
}

# expect_line REGEX: some line of the last stdout matches
expect_line() {
    if ! grep -Eq -- "$1" "$tmp/out"; then
        fail "$label: no line matching '$1' in the output:"
        sed 's/^/    | /' "$tmp/out" | head -40 >&2
    fi
}

# json_check PYTHON-EXPRESSION (over d = the document): must be true
json_check() {
    if ! python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
sys.exit(0 if eval(sys.argv[2]) else 1)' "$tmp/out" "$1" 2>>"$tmp/pyerr"; then
        fail "$label: --json: expected $1"
    fi
}

# ---------------------------------------------------------------- good models
# folder | layers | hidden | heads line | parameters | tensors | files | extra regex
models=(
    "$BK_TEST_DATA/models/tiny-llama3|2|128|8 \(kv heads 2, head_dim 16\)|418432|21|10|rope +llama3, theta 500000, factor 8, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 64"
    "$BK_TEST_DATA/models/tiny-qwen2|2|64|4 \(kv heads 2, head_dim 16\)|111936|26|1|biases +q/k/v yes, o_proj no, mlp no"
    "$BK_TEST_DATA/models/tiny-qwen3|3|96|6 \(kv heads 2, head_dim 32\)|348000|36|1|q/k norms +yes"
    "$BK_TEST_DATA/models/tiny-qwen3-bf16|3|96|6 \(kv heads 2, head_dim 32\)|348000|36|1|dtypes +BF16: 36 tensors"
    "$BK_SOURCE_ROOT/examples/kerneldocs-1.6m|4|192|6 \(kv heads 2, head_dim 32\)|1623744|38|1|tied embeddings +yes"
)
for row in "${models[@]}"; do
    IFS='|' read -r dir layers hidden heads params ntensors nfiles extra <<<"$row"
    label="inspect $(basename "$dir")"
    run inspect "$dir"
    if [ "$rc" -ne 0 ]; then
        fail "$label: exit $rc: $(cat "$tmp/err")"
        continue
    fi
    [ -s "$tmp/err" ] && fail "$label: unexpected stderr: $(cat "$tmp/err")"
    expect_line ": model folder$"
    expect_line "^  layers +$layers$"
    expect_line "^  hidden size +$hidden$"
    expect_line "^  attention heads +$heads$"
    expect_line "^  parameters +$params "
    expect_line "^  implied parameters +$params "
    expect_line "^  tensors +$ntensors$"
    expect_line "^  files +$nfiles$"
    expect_line "$extra"
    expect_line "^  model\.layers\.0\.self_attn\.q_proj\.weight "
    [ "$nfiles" -gt 1 ] && expect_line "^  tensor +dtype +shape +bytes +file$"

    label="inspect --json $(basename "$dir")"
    run inspect --json "$dir"
    if [ "$rc" -ne 0 ]; then
        fail "$label: exit $rc: $(cat "$tmp/err")"
        continue
    fi
    python3 -m json.tool "$tmp/out" >/dev/null 2>&1 || fail "$label: output is not valid JSON"
    json_check "d['kind'] == 'model' and d['parameters'] == $params"
    json_check "d['config']['num_hidden_layers'] == $layers and d['config']['hidden_size'] == $hidden"
    json_check "len(d['tensors']) == $ntensors and len(d['files']) == $nfiles"
    json_check "sum(t['bytes'] for t in d['tensors']) == d['bytes']"
done

# ------------------------------------------------------ files, index, config
label="inspect model.safetensors"
run inspect "$BK_TEST_DATA/models/tiny-qwen2/model.safetensors"
[ "$rc" -eq 0 ] || fail "$label: exit $rc: $(cat "$tmp/err")"
expect_line ": safetensors file$"
expect_line "^  tensors +26$"
expect_line "^  parameters +111936 "
expect_line "metadata format=pt"

label="inspect --json model.safetensors"
run inspect "$BK_TEST_DATA/models/tiny-qwen2/model.safetensors" --json
[ "$rc" -eq 0 ] || fail "$label: exit $rc: $(cat "$tmp/err")"
python3 -m json.tool "$tmp/out" >/dev/null 2>&1 || fail "$label: output is not valid JSON"
json_check "d['kind'] == 'file' and 'config' not in d and d['files'][0]['metadata'] == {'format': 'pt'}"

label="inspect folder without config.json"
mkdir "$tmp/ckpt"
cp "$BK_TEST_DATA/models/tiny-qwen3/model.safetensors" "$tmp/ckpt/"
run inspect "$tmp/ckpt"
[ "$rc" -eq 0 ] || fail "$label: exit $rc: $(cat "$tmp/err")"
expect_line ": checkpoint folder$"
expect_line "^  tensors +36$"
expect_line "^  parameters +348000 "
expect_line "^  model\.layers\.2\.self_attn\.k_norm\.weight +F32 +\[32\] +128$"

label="inspect index.json"
run inspect "$BK_TEST_DATA/models/tiny-llama3/model.safetensors.index.json"
[ "$rc" -eq 0 ] || fail "$label: exit $rc: $(cat "$tmp/err")"
expect_line ": sharded index$"
expect_line "^  files +10$"
expect_line "^  tensors +21$"
expect_line "^  lm_head\.weight +F32 +\[256, 128\] +131072 +model-00010-of-00010\.safetensors$"

label="inspect config.json"
run inspect "$BK_TEST_DATA/models/tiny-llama3/config.json"
[ "$rc" -eq 0 ] || fail "$label: exit $rc: $(cat "$tmp/err")"
expect_line ": config.json$"
expect_line "^  implied parameters +418432 "
label="inspect --json config.json"
run inspect --json "$BK_TEST_DATA/models/tiny-qwen3/config.json"
[ "$rc" -eq 0 ] || fail "$label: exit $rc: $(cat "$tmp/err")"
json_check "d['kind'] == 'config' and d['config']['head_dim'] == 32 and d['config']['qk_norm'] is True and 'tensors' not in d"

# ------------------------------------------------------------------ usage
label="inspect --help"
run inspect --help
[ "$rc" -eq 0 ] || fail "$label: exit $rc"
expect_line "^usage: bakron inspect PATH \[--json\]"
for args in "" "--bogus $BK_TEST_DATA/models/tiny-qwen2" "a b"; do
    label="inspect $args"
    # shellcheck disable=SC2086
    run inspect $args
    [ "$rc" -eq 1 ] || fail "$label: exit $rc, expected 1 (usage)"
done

# ---------------------------------------------------------- malformed inputs
nbad=0
json_done=" "
for entry in "$BK_TEST_DATA"/bad/*/*; do
    case "$(basename "$entry")" in
        README* | *.md | *.txt | *.py) continue ;;
    esac
    label="inspect ${entry#"$BK_TEST_DATA"/}"
    nbad=$((nbad + 1))
    run inspect "$entry"
    lines=$(wc -l <"$tmp/err")
    if [ "$rc" -ne 2 ]; then
        fail "$label: exit $rc, expected 2; stderr: $(head -3 "$tmp/err")"
    elif [ "$lines" -ne 1 ]; then
        fail "$label: $lines lines on stderr, expected exactly 1:"
        sed 's/^/    | /' "$tmp/err" | head -10 >&2
    elif [ -s "$tmp/out" ]; then
        fail "$label: printed a report on stdout despite the error"
    fi
    # --json once per corpus folder (each bakron start costs ~0.2 s with CUDA)
    group=$(basename "$(dirname "$entry")")
    case "$json_done" in *" $group "*) continue ;; esac
    json_done="$json_done$group "
    run inspect --json "$entry"
    [ "$rc" -eq 2 ] || fail "$label --json: exit $rc, expected 2"
    [ -s "$tmp/out" ] && fail "$label --json: printed a report on stdout despite the error"
done
[ "$nbad" -ge 60 ] || fail "only $nbad malformed inputs found under $BK_TEST_DATA/bad"

# a path that exists but is neither a file nor a folder is named as what it is
mkfifo "$tmp/fifo"
for p in /dev/null "$tmp/fifo" "$tmp/nothere"; do
    label="inspect $p"
    run inspect "$p"
    case "$p" in
        /dev/null) want="is a device, not a regular file or a folder" ;;
        *fifo) want="is a FIFO \(named pipe\), not a regular file or a folder" ;;
        *) want="no such file or directory" ;;
    esac
    [ "$rc" -eq 2 ] && [ "$(wc -l <"$tmp/err")" -eq 1 ] && grep -Eq -- "^bakron inspect: error: $p: $want" "$tmp/err" ||
        fail "$label: exit $rc, expected 2 and '$want': $(cat "$tmp/err")"
done

echo "cli_inspect: $checks runs, $nbad malformed inputs, $failures failure(s)"
[ "$failures" -eq 0 ]
