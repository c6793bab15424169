#!/usr/bin/env bash
# bakron merge checks each part's report.json for what it merges from it (an
# object with "modules": an array of objects, "times_s": an object,
# "quantized_parameters", "peak_device_bytes": numbers, "quantization": an
# object): a part whose report.json is {} or lacks one of them, or has it of
# another type, is refused before anything is written: one line naming the
# part's report.json and the field, exit 2, no output folder, work folder or lock.
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
cd "$W" || exit 1

"$B" quantize "$M" --hessian rtn --layers 0:2 --out r1 2>/dev/null &&
    "$B" quantize "$M" --hessian rtn --layers 2:4 --out r2 2>/dev/null ||
    { echo "FAIL: rtn parts"; exit 1; }

# refused WHY EXPECTED-REGEX PYTHON-EXPR: r2's report.json replaced by the
# expression's value (r = the original report), the merge must be refused
refused() {
    local why=$1 words=$2 expr=$3
    rm -rf bad && cp -r r2 bad
    python3 -c '
import json, sys
r = json.load(open("r2/report.json"))
v = eval(sys.argv[1])
open("bad/report.json", "w").write(json.dumps(v))' "$expr" || { die "$why: python"; return; }
    "$B" merge r1 bad --out out >/dev/null 2>err; local rc=$?
    [ $rc -eq 2 ] || die "$why: exit $rc, expected 2 ($(cat err))"
    [ "$(wc -l <err)" -eq 1 ] || die "$why: not one line: $(cat err)"
    grep -qE -- "bad/report\.json: .*$words" err || die "$why: message lacks 'bad/report.json: ...$words': $(cat err)"
    ls -A | grep -qE '^out|^\.out\.lock' && die "$why: left $(ls -A | grep -E '^out|^\.out' | tr '\n' ' ')"
    rm -rf out
    echo "refused ($why): exit $rc: $(cut -c1-200 err)"
}
refused "report.json is {}" "modules" '{}'
refused "an array" "not a JSON object" '[]'
for k in modules times_s quantized_parameters peak_device_bytes quantization; do
    refused "no $k" "$k" "{a: b for a, b in r.items() if a != '$k'}"
done
refused "modules not an array" "modules" "dict(r, modules={})"
refused "a module entry not an object" "modules" "dict(r, modules=r['modules'] + [3])"
refused "times_s not an object" "times_s" "dict(r, times_s=[1, 2])"
refused "quantized_parameters a string" "quantized_parameters" "dict(r, quantized_parameters='12')"
refused "peak_device_bytes null" "peak_device_bytes" "dict(r, peak_device_bytes=None)"
refused "quantization a string" "quantization" "dict(r, quantization='rtn')"
# the first part too
cp -r r1 bad1 && echo '{}' >bad1/report.json
"$B" merge bad1 r2 --out out >/dev/null 2>err; rc=$?
[ $rc -eq 2 ] && grep -q "bad1/report\.json: " err || die "first part's {}: exit $rc: $(cat err)"
rm -rf out
# --json: the refusal is also one `error` event on stdout (as quantize's), the
# stderr line unchanged
"$B" merge r1 bad1 --out out --json >out.json 2>err; rc=$?
[ $rc -eq 2 ] || die "--json: exit $rc, expected 2"
python3 -c '
import json, sys
lines = open("out.json").read().splitlines()
assert len(lines) == 1, lines
e = json.loads(lines[0])
assert e["event"] == "error" and e["exit_code"] == 2 and e["layer"] is None, e
assert "bad1/report.json" in e["message"], e' || die "--json: the error event: $(cat out.json)"
grep -q "bad1/report\.json: " err || die "--json: the stderr line: $(cat err)"
rm -rf out
# the good parts still merge
"$B" merge r1 r2 --out out 2>err || die "merge of the good parts: $(cat err)"
[ $fail -eq 0 ] && echo "all merge report.json checks passed"
exit $fail
