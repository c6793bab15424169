#!/usr/bin/env bash
# bakron merge stopped by SIGINT, SIGTERM or SIGHUP (as quantize is): it stops
# at its next check, removes its work folder OUT.tmp-PID and its lock, leaves
# an existing OUT as it was, says it was interrupted in one line and exits 3;
# under nohup (SIGHUP ignored at the start) a hangup does not stop it. The
# test hook BK_FAULT_PAUSE_AT=merge-write holds the merge for up to 2 s once
# its work folder has data in it (docs/DEVELOPING.md), so the signal lands
# mid-merge every time.
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
ok=1
bad() { die "$@"; ok=0; } # a failure of the current case
cd "$W" || exit 1

"$B" quantize "$M" --hessian rtn --layers 0:2 --out r1 2>/dev/null &&
    "$B" quantize "$M" --hessian rtn --layers 2:4 --out r2 2>/dev/null ||
    { echo "FAIL: rtn parts"; exit 1; }
"$B" merge r1 r2 --out m 2>/dev/null || { echo "FAIL: first merge"; exit 1; }
(cd m && sha256sum -- * >../m.sums) || exit 1

# paused_merge [PREFIX...]: start `merge r1 r2 --out m --overwrite` in the
# background with the pause hook (stderr in err); pid in $pid; returns 1 when
# the pause was not reached within 10 s
paused_merge() {
    rm -f err
    BK_FAULT_PAUSE_AT=merge-write "$@" "$B" merge r1 r2 --out m --overwrite --json >out.json 2>err &
    pid=$!
    for _ in $(seq 500); do
        grep -q "paused at merge-write" err 2>/dev/null && return 0
        kill -0 $pid 2>/dev/null || break
        sleep 0.02
    done
    return 1
}

for sig in INT TERM HUP; do
    ok=1
    if ! paused_merge; then
        wait $pid; rc=$?
        bad "SIG$sig: the merge never reached the pause hook (exit $rc): $(tail -1 err)"
        continue
    fi
    kill -$sig $pid
    wait $pid; rc=$?
    msg=$(grep -v "paused at merge-write" err)
    [ $rc -eq 3 ] || bad "SIG$sig: exit $rc, expected 3: $(cat err)"
    [ "$(printf '%s\n' "$msg" | grep -c .)" -eq 1 ] || bad "SIG$sig: not one line: $(cat err)"
    grep -q "^bakron merge: error: .*interrupted" <<<"$msg" ||
        bad "SIG$sig: the line does not say it was interrupted: $msg"
    left=$(ls -A | grep -E '^m\.(tmp|old)-|^\.m\.lock$')
    [ -z "$left" ] || bad "SIG$sig: left $left"
    (cd m && sha256sum -c --quiet ../m.sums) >/dev/null 2>&1 ||
        bad "SIG$sig: the existing output m was changed"
    [ "$(ls m | wc -l)" -eq "$(wc -l <m.sums)" ] || bad "SIG$sig: files added to m"
    # --json: the last event on stdout says so
    tail -1 out.json | python3 -c '
import json, sys
e = json.loads(sys.stdin.read())
assert e["event"] == "interrupted" and e["exit_code"] == 3, e' ||
        bad "SIG$sig: no interrupted event on stdout: $(tail -1 out.json)"
    [ $ok -eq 1 ] && echo "ok: SIG$sig: exit $rc, $msg"
done

# nohup: the hangup is ignored, the merge completes (exit 0)
if paused_merge nohup; then
    kill -HUP $pid
    wait $pid; rc=$?
    [ $rc -eq 0 ] || die "nohup: a hangup stopped the merge (exit $rc): $(tail -1 err)"
    [ -z "$(ls -A | grep -E '^m\.(tmp|old)-|^\.m\.lock$')" ] || die "nohup: leftovers"
    (cd m && sha256sum -c --quiet ../m.sums) >/dev/null 2>&1 || die "nohup: output differs"
    echo "ok: nohup: the hangup was ignored (exit $rc)"
else
    wait $pid; die "nohup: the merge never reached the pause hook: $(tail -1 err)"
fi
[ $fail -eq 0 ] && echo "all merge signal checks passed"
exit $fail
