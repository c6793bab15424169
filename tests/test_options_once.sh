#!/usr/bin/env bash
# An option given twice is a usage error naming it (exit 1, one line), for
# every command, in every spelling (--opt V, --opt=V, an abbreviation getopt
# accepts, a flag); never silently the last one. --setting repeats, and so do
# merge's PART_DIRs.
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
cd "$W" || exit 1

# twice OPTION CMD...: exit 1, exactly one line on stderr naming OPTION as given twice
twice() {
    local opt=$1; shift
    "$B" "$@" >out 2>err
    local rc=$? lines
    lines=$(wc -l <err)
    [ $rc = 1 ] || die "$*: exit $rc, expected 1 ($(tail -1 err))"
    [ "$lines" = 1 ] || die "$*: $lines lines on stderr, expected 1: $(head -3 err)"
    grep -qE -- "^bakron [a-z-]+: error: $opt given twice" err || die "$*: message does not name $opt: $(cat err)"
    echo "ok: $(cat err)"
}

CAL=(--calib "$M/calib.safetensors" --samples 2 --backend cpu)
twice "--out" quantize "$M" "${CAL[@]}" --hessian gptq --out A --out B
[ -e A ] || [ -e B ] && die "quantize wrote an output despite --out twice"
twice "--out" quantize "$M" "${CAL[@]}" --hessian gptq --ou A --out=B
twice "--hessian" quantize "$M" "${CAL[@]}" --hessian gptq --hessian=rtn --out A
twice "--calib" quantize "$M" "${CAL[@]}" --calib "$M/calib.safetensors" --hessian gptq --out A
twice "--levels" quantize "$M" "${CAL[@]}" --hessian gptq --levels 3 --levels 2 --out A
twice "--json" quantize "$M" "${CAL[@]}" --hessian gptq --json --json --out A
# (with --json the error is also an event on stdout, as every quantize error is)
grep -q '"event":"error".*"exit_code":1,"message":"--json given twice' out ||
    die "quantize --json --json: no error event: $(cat out)"
twice "--overwrite" quantize "$M" "${CAL[@]}" --hessian gptq --overwrite --overwrite --out A
twice "--tokens" eval "$M" --tokens "$M/eval.safetensors" --tokens=x
twice "--samples" eval "$M" --samples 2 --tokens "$M/eval.safetensors" --samples 3
twice "--json" eval "$M" --json --tokens "$M/eval.safetensors" --json
twice "--json" inspect "$M" --json --json
twice "--out" dump-activations "$M" --calib "$M/calib.safetensors" --out a --out b
twice "--out" merge p1 p2 --out a --out b
twice "--out" solve --weight w.st:w --hessian-a a.st:a --out a --out b
twice "--levels" solve --weight w.st:w --hessian-a a.st:a --levels 3 --levels 2 --out a
twice "--repeat" bench --repeat 1 --repeat 2
twice "--damp" bench --damp 0.1 --damp=0.2
twice "--config" quantize "$M" "${CAL[@]}" --config paper-2.81bit-gptq --config paper-2.81bit-rtn --out A

# the repeatable ones
"$B" eval "$M" --tokens "$M/eval.safetensors" --samples 2 --backend cpu \
    --setting keep_down=1 --setting keep_down=0 >out 2>err || die "eval --setting twice: $(cat err)"
"$B" quantize "$M" "${CAL[@]}" --hessian gptq --setting keep_down=1 --setting keep_down=0 \
    --dry-run --out A >out 2>err || die "quantize --setting twice: $(cat err)"
"$B" merge p1 p2 --out a >out 2>err
grep -q 'twice' err && die "merge: two PART_DIRs taken as an option given twice: $(cat err)"

exit $fail
