#!/usr/bin/env bash
# --resume with a journal that is not a journal (garbage, a line that is no
# record, binary bytes): the run starts over from the first layer (safe) and
# says why in one line naming the journal file and that it is not a valid
# journal — not another reason ("had finished no layer", a digest mismatch).
# A journal torn while a line was appended (a prefix of a record) is still a
# journal: its complete records are kept.
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
ok=1
bad() { die "$@"; ok=0; } # a failure of the current case
cd "$W" || exit 1
export OPENBLAS_NUM_THREADS=1
args=(--calib "$M/calib.safetensors" --samples 4 --seqlen 32 --backend cpu --hessian gptq)

"$B" quantize "$M" "${args[@]}" --out ref >/dev/null 2>&1 || { echo "FAIL: reference run"; exit 1; }

# a run killed after its 2nd journal line (exit 137; the shell's "Killed" not shown)
kill_after_2() {
    BK_FAULT_KILL_AT=journal-after-2 bash -c '"$@" >/dev/null 2>&1; exit $?' _ \
        "$B" quantize "$M" "${args[@]}" --out q 2>/dev/null
}
# the progress lines aside
notes() { grep -v -E '^  |^layer ' err; }

# killed KIND CONTENT: a run killed after its 2nd journal line, then its
# journal replaced (printf CONTENT), then --resume
killed() {
    rm -rf q q.tmp-* .q.lock
    kill_after_2
    [ $? -eq 137 ] || { bad "$1: the fault point was not reached"; return 1; }
    j=$(echo q.tmp-*/.resume/journal)
    [ -f "$j" ] || { bad "$1: no journal"; return 1; }
    printf "$2" >"$j"
    "$B" quantize "$M" "${args[@]}" --out q --resume >/dev/null 2>err; rc=$?
    [ $rc -eq 0 ] || { bad "$1: --resume exit $rc: $(tail -1 err)"; return 1; }
    [ "$(cmp -s q/model.safetensors ref/model.safetensors && echo same)" = same ] ||
        bad "$1: the output differs from an uninterrupted run's"
}
for case in "garbage line:not a journal\n" "binary:\x00\xff\x1b garbage" "empty object line:{}\n" \
    "a record then garbage:%s\n\x01\x02 junk\n"; do
    name=${case%%:*}; content=${case#*:}
    if [ "$name" = "a record then garbage" ]; then
        # a valid first record, then a line that is no record
        rm -rf q q.tmp-* .q.lock
        kill_after_2
        rec=$(head -1 q.tmp-*/.resume/journal | sed 's/%/%%/g; s/\\/\\\\/g')
        content=$(printf '%s' "$content" | sed "s|%s|$rec|")
        rm -rf q.tmp-* .q.lock
    fi
    ok=1
    killed "$name" "$content" || continue
    n=$(grep -c "journal" err)
    line=$(grep "journal" err | head -1)
    grep -qE "q\.tmp-[0-9]+/\.resume/journal: not a valid journal" err ||
        bad "$name: no line naming the journal and saying it is not valid: $(notes)"
    grep -qE "starting over from layer 0" <<<"$line" || bad "$name: does not say it starts over: $line"
    [ "$n" -eq 1 ] || bad "$name: $n lines about the journal: $(notes)"
    grep -q "had finished no layer\|differ from the journal" err &&
        bad "$name: a misleading reason: $(grep 'finished no layer\|differ from the journal' err)"
    LC_ALL=C grep -q $'[\x01\x02\x1b]' err && bad "$name: raw control bytes in the message"
    [ $ok -eq 1 ] && echo "ok ($name): $line"
done
# a torn last line (a prefix of a record) is not garbage: the 2 records are kept
rm -rf q q.tmp-* .q.lock
kill_after_2
printf '{"layer":2,"dig' >>q.tmp-*/.resume/journal
"$B" quantize "$M" "${args[@]}" --out q --resume >/dev/null 2>err || die "torn: $(tail -1 err)"
grep -q "layers 0-1 were finished by the interrupted run and are kept" err ||
    die "torn last line: the records were not kept: $(notes)"
grep -q "not a valid journal" err && die "torn last line called invalid: $(notes)"
cmp -s q/model.safetensors ref/model.safetensors || die "torn: output differs"
[ $fail -eq 0 ] && echo "all resume journal checks passed"
exit $fail
