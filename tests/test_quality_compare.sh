#!/usr/bin/env bash
# scripts/quality_compare.py: paired differences and gap closed across protocol
# folders, on hand-made summary.json files whose answers are worked out below;
# folders with different FP perplexities or without the variant are refused.
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
cd "$W" || exit 1
mk() { # DIR FP PER_DRAW_JSON
    mkdir -p "$1"
    printf '{"fp_perplexity": %s, "samples": 8, "pool": "p", "eval": "e", "per_draw": %s}\n' "$2" "$3" >"$1/summary.json"
}
mk ref 4 '{"0": {"a": 10}, "1": {"a": 12}, "2": {"a": 14}}'
mk run 4 '{"0": {"a": 9}, "1": {"a": 12.5}, "2": {"a": 12}, "3": {"a": 1}}'
mk g 4 '{"0": {"gptq": 20}, "1": {"gptq": 22}, "2": {"gptq": 24}}'
out=$(python3 "$SRC/scripts/quality_compare.py" --ref ref:a --gptq g:gptq run:a) || die "compare failed"
echo "$out"
# draws 0-2 in common (draw 3 only in run); differences -1, +0.5, -2: mean -0.833,
# sd 1.258, se 0.726; lower on 2 of 3. Gap closed: 11/16, 9.5/18, 12/20 -> 60.5%,
# se 4.6%; wins 3/3. Mean ppl 11.167, se 1.093.
grep -q '^3 paired draws (0, 1, 2); FP perplexity 4.0000' <<<"$out" || die "draws line"
grep -qF '| run:a | 11.167 | 1.093 | -0.833 ± 0.726 | 2/3 | +60.5% ± 4.6% | 3/3 |' <<<"$out" || die "row"
mk other 5 '{"0": {"a": 9}, "1": {"a": 12.5}, "2": {"a": 12}}'
if python3 "$SRC/scripts/quality_compare.py" --ref ref:a other:a 2>err.txt; then die "different FP accepted"; fi
grep -q "differ in fp" err.txt || die "FP message: $(cat err.txt)"
if python3 "$SRC/scripts/quality_compare.py" ref:b 2>err.txt; then die "missing variant accepted"; fi
grep -q "no draws of variant 'b'" err.txt || die "variant message: $(cat err.txt)"
[ $fail = 0 ] && echo "quality_compare: ok"
exit $fail
