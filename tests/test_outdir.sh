#!/usr/bin/env bash
# Output folders (issue 14, points 1-3, 7, 8): an unsafe --out is refused with
# exit 1 before any work and nothing is touched; --overwrite replaces the old
# output atomically (a kill at any point of the commit leaves the old or the
# new output complete, and the next run recognises the leftovers); the lock
# makes the second of two runs on one --out fail at once (exit 3); stale locks
# and killed runs' work folders are cleared with a message.
# RTN quantization of the bundled example model (no calibration: fast).
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
cp -r "$SRC/examples/kerneldocs-1.6m" "$W/m"
mkdir "$W/p" && cp -r "$W/m" "$W/p/m" && echo "another file" >"$W/p/other.txt"
echo "an unrelated file" >"$W/notes.txt"
cd "$W" || exit 1

fingerprint() { # every file under the test folder except outputs: path + sha256
    (cd "$W" && find . -path ./ref2 -prune -o -path ./ref3 -prune -o -name err -o -type f -print0 |
        sort -z | xargs -0 sha256sum)
}
q() { "$B" quantize "$@" --hessian rtn 2>"$W/err"; }

# --- unsafe outputs: exit 1, one line, nothing changed --------------------
before=$(fingerprint)
expect_refused() { # why args...
    local why=$1; shift
    q "$@"; local rc=$?
    [ $rc -eq 1 ] || die "$why: exit $rc, expected 1 ($(cat "$W/err"))"
    [ "$(wc -l <"$W/err")" -eq 1 ] || die "$why: not one line: $(cat "$W/err")"
    [ "$(fingerprint)" = "$before" ] || die "$why: files changed"
    ls -a "$W" | grep -q -E '\.(tmp|old)-|\.lock$' && die "$why: left $(ls -a "$W" | tr '\n' ' ')"
    echo "refused ($why): $(cut -c1-140 "$W/err")"
}
expect_refused "out is the model folder" m --out m --overwrite
expect_refused "out is the model folder (trailing slash)" m --out m/ --overwrite
expect_refused "out is the model's parent" p/m --out p --overwrite
expect_refused "out is the model's parent (absolute)" p/m --out "$W/p" --overwrite
expect_refused "out is the model's parent, via .." p/m --out p/m/.. --overwrite
expect_refused "out is the model's parent, via ./" p/m --out ./p/./ --overwrite
expect_refused "out inside the model folder" m --out m/q
expect_refused "out is the current folder" m --out . --overwrite
expect_refused "out is a parent of the current folder" m --out .. --overwrite
expect_refused "empty out" m --out ''
expect_refused "out is a file" m --out notes.txt --overwrite
expect_refused "out is the root" m --out / --overwrite
expect_refused "out name leaves no room for NAME.tmp-PID" m --out "$(printf 'x%.0s' $(seq 250))"
ln -s m link
before=$(fingerprint)
expect_refused "out is a symbolic link" m --out link --overwrite
expect_refused "calibration file inside out" m --calib m/calib.safetensors --out m --overwrite
(cd m && "$B" quantize . --hessian rtn --out . --overwrite 2>"$W/err"); rc=$?
[ $rc -eq 1 ] || die "quantize . --out . (inside the model folder): exit $rc"
[ "$(fingerprint)" = "$before" ] || die "quantize . --out .: files changed"
# dump-activations writes a folder too
"$B" dump-activations m --calib m/calib.safetensors --samples 2 --out m --overwrite 2>"$W/err"; rc=$?
[ $rc -eq 1 ] || die "dump-activations --out MODEL: exit $rc ($(cat "$W/err"))"
[ "$(fingerprint)" = "$before" ] || die "dump-activations --out MODEL: files changed"
# the model folder links to files elsewhere (a Hugging Face cache): --out over them
mkdir -p blobs hf && mv m/model.safetensors blobs/ && ln -s ../blobs/model.safetensors hf/model.safetensors
cp m/config.json hf/
before=$(fingerprint)
expect_refused "out holds the files the model folder links to" hf --out blobs --overwrite
mv blobs/model.safetensors m/ && rm -rf blobs hf
before=$(fingerprint)

# --- an existing output: refused before any work without --overwrite ----
q m --levels 3 --out ref3 || die "ref3: $(cat err)"
q m --levels 2 --out ref2 || die "ref2: $(cat err)"
q m --levels 3 --out q || die "q: $(cat err)"
q m --levels 2 --out q; rc=$?
[ $rc -eq 1 ] || die "existing non-empty --out without --overwrite: exit $rc"
grep -q "overwrite" err || die "no hint at --overwrite: $(cat err)"
cmp -s q/model.safetensors ref3/model.safetensors || die "refused run changed the old output"
q m --levels 2 --out q --overwrite || die "--overwrite: $(cat err)"
cmp -s q/model.safetensors ref2/model.safetensors || die "--overwrite: not the new output"
ls | grep -q -E '\.(tmp|old)-' && die "--overwrite left $(ls)"

# --- killed at each point of the commit: old or new output, complete -----
is_complete() { # folder: one of the references, byte for byte
    cmp -s "$1/model.safetensors" ref2/model.safetensors && cmp -s "$1/config.json" ref2/config.json && echo new && return
    cmp -s "$1/model.safetensors" ref3/model.safetensors && cmp -s "$1/config.json" ref3/config.json && echo old && return
    echo broken
}
for mode in exchange noexchange; do
    for pt in commit-begin commit-swapped commit-old-aside commit-aside; do
        [ $mode = exchange ] && [ $pt = commit-aside ] && continue
        [ $mode = noexchange ] && { [ $pt = commit-swapped ] || [ $pt = commit-old-aside ]; } && continue
        rm -rf q && cp -r ref3 q
        ne=0; [ $mode = noexchange ] && ne=1
        BK_FAULT_NO_EXCHANGE=$ne BK_FAULT_KILL_AT=$pt "$B" quantize m --hessian rtn --levels 2 \
            --out q --overwrite 2>/dev/null
        rc=$?
        [ $rc -eq 137 ] || die "$mode $pt: not killed (exit $rc)"
        state="missing"
        [ -d q ] && state=$(is_complete q)
        # the next run (no --overwrite) sees the leftovers: restores or removes them
        q m --levels 2 --out q; rc2=$?
        after="missing"
        [ -d q ] && after=$(is_complete q)
        echo "killed at $pt ($mode): output $state; next run: exit $rc2, output $after: $(tr '\n' ' ' <err | cut -c1-200)"
        case "$state" in old|new) ;; missing) [ $pt = commit-aside ] || die "$pt: no output" ;; *) die "$pt: broken output" ;; esac
        case "$after" in old|new) ;; *) die "$pt: after the next run: output $after" ;; esac
        ls | grep -q -E '\.(tmp|old)-' && die "$pt: leftovers not cleaned: $(ls)"
        [ -e .q.lock ] && die "$pt: lock file left"
        grep -q "killed run" err || die "$pt: no message about the killed run's leftover"
    done
done
[ -d q ] && [ "$(is_complete q)" != broken ] || die "output broken at the end"

# --- the lock ---------------------------------------------------------------
exec 9>"$W/.q.lock"
flock 9
echo "pid 12345 on somewhere" >&9
q m --levels 2 --out q --overwrite; rc=$?
[ $rc -eq 3 ] || die "locked output: exit $rc, expected 3 ($(cat err))"
grep -q "another bakron run" err && grep -q "pid 12345 on somewhere" err || die "lock message: $(cat err)"
echo "locked: $(cat err)"
exec 9>&-
# a stale lock (its process gone: no flock held) is cleared with a message
echo "pid 999999 on elsewhere, started long ago" >"$W/.q.lock"
q m --levels 2 --out q --overwrite || die "stale lock: $(cat err)"
grep -q "stale lock" err || die "stale lock not reported: $(cat err)"
[ -e .q.lock ] && die "lock file left after the run"

# --- a killed run's work folder (a full-size shard) is removed ------------
mkdir q.tmp-999998 && head -c 1000000 /dev/zero >q.tmp-999998/model.safetensors
q m --levels 2 --out q --overwrite || die "leftover: $(cat err)"
grep -q "removed q.tmp-999998, left by a killed run" err || die "leftover not reported: $(cat err)"
[ -e q.tmp-999998 ] && die "leftover not removed"

# --- an output file (eval --logits-out) over an input, inside the model folder,
# or over a folder / FIFO: exit 1 before any work, nothing changed
cp m/eval.safetensors tok.safetensors && mkfifo fifo
before_lo=$(fingerprint)
for lo in tok.safetensors ./tok.safetensors m/model.safetensors m/new.safetensors m fifo; do
    "$B" eval m --tokens tok.safetensors --samples 2 --backend cpu --logits-out "$lo" \
        >/dev/null 2>"$W/err"; rc=$?
    [ $rc -eq 1 ] && [ "$(wc -l <"$W/err")" -eq 1 ] && grep -q -- "--logits-out $lo: " err ||
        die "eval --logits-out $lo: exit $rc, expected 1 and one line ($(cat "$W/err"))"
    [ "$(fingerprint)" = "$before_lo" ] || die "eval --logits-out $lo: files changed"
    [ -p fifo ] || die "eval --logits-out $lo: the FIFO was replaced"
    echo "refused (eval --logits-out $lo): $(cut -c1-120 "$W/err")"
done
rm -f tok.safetensors fifo

# --- an existing output this user cannot replace: refused before the work
# (exit 3, one line), not found at the commit after it (a swap refused in a
# sticky folder) nor committed with OUT.old-PID left beside (files it may
# not delete)
as_other=() # root ignores permissions: run as nobody
[ "$(id -u)" -eq 0 ] && as_other=(setpriv --reuid=65534 --regid=65534 --clear-groups)
mkdir -p rw && chmod 777 rw && chmod o+x "$W"
if "${as_other[@]}" test -r m/model.safetensors -a -w rw 2>/dev/null &&
    "${as_other[@]}" "$B" --version >/dev/null 2>&1; then
    # sticky: a folder like /tmp, the output another user's (empty: no --overwrite needed)
    for sticky in 0 1; do
        rm -rf rw/qro && mkdir rw/qro
        if [ $sticky = 1 ]; then
            chmod 1777 rw && chmod 777 rw/qro && why="cannot be replaced: it belongs to another user"
        else
            echo "someone else's" >rw/qro/f && chmod 555 rw/qro && why="--overwrite cannot delete"
        fi
        before_ro=$(ls -A rw rw/qro | tr '\n' ' ')
        for cmd in "quantize m --hessian rtn" "merge q" "dump-activations m --calib m/calib.safetensors --samples 2"; do
            # shellcheck disable=SC2086 # cmd: words
            "${as_other[@]}" "$B" $cmd --out rw/qro --overwrite 2>"$W/err"; rc=$?
            [ $rc -eq 3 ] && [ "$(wc -l <"$W/err")" -eq 1 ] && grep -q "rw/qro: $why" err ||
                die "$cmd, an output of another user (sticky $sticky): exit $rc ($(cat "$W/err"))"
            [ "$(ls -A rw rw/qro | tr '\n' ' ')" = "$before_ro" ] ||
                die "$cmd, an output of another user (sticky $sticky): left $(ls -A rw rw/qro | tr '\n' ' ')"
        done
        echo "an output of another user (sticky $sticky): $(cat "$W/err")"
        chmod 777 rw rw/qro
    done
else
    echo "an output of another user: no other user to run as (not tested)"
fi
rm -rf rw

# --- a write the process may not make is an error, never a signal death ----
# a file-size limit (ulimit -f; SIGXFSZ by default): exit 3, one line naming the
# file, nothing left (no output, work folder or lock)
(ulimit -f 500 && exec "$B" quantize m --hessian rtn --out qf 2>"$W/err"); rc=$?
[ $rc -eq 3 ] || die "ulimit -f: exit $rc, expected 3 ($(cat "$W/err"))"
[ "$(wc -l <"$W/err")" -eq 1 ] && grep -q "qf.tmp-[0-9]*/model.safetensors: .*File too large" err ||
    die "ulimit -f: not one line naming the file: $(cat "$W/err")"
ls -a | grep -q -E '^qf($|\.tmp-)|^\.qf\.lock$' && die "ulimit -f: left $(ls -a | tr '\n' ' ')"
echo "file-size limit: $(cat "$W/err")"
# stdout / stderr a pipe nobody reads (`| head -1` that ended; SIGPIPE by default):
# the run is not killed mid-way, the output is complete and the lock released
closed_pipe() { # stdout|stderr CMD...: run CMD with that stream a pipe whose reader is gone
    python3 -c 'import os, subprocess, sys
r, w = os.pipe(); os.close(r)
kw = {sys.argv[1]: w}
rc = subprocess.run(sys.argv[2:], **kw).returncode
sys.exit(128 - rc if rc < 0 else rc)' "$@"
}
"$B" quantize m --hessian rtn --json --out qref >/dev/null 2>&1 || die "reference run failed"
for s in stdout stderr; do # the events (--json) or the progress lines
    rm -rf qp
    json=; [ $s = stdout ] && json=--json
    closed_pipe $s "$B" quantize m --hessian rtn $json --out qp 2>"$W/err" >/dev/null; rc=$?
    [ $rc -eq 0 ] || die "$s a closed pipe: exit $rc, expected 0 (signal $((rc - 128)) if > 128)"
    cmp -s qp/model.safetensors qref/model.safetensors && [ -f qp/report.json ] ||
        die "$s a closed pipe: output incomplete"
    ls -a | grep -q -E '^qp\.tmp-|^\.qp\.lock$' && die "$s a closed pipe: left $(ls -a | tr '\n' ' ')"
done
closed_pipe stdout "$B" inspect m 2>"$W/err"; rc=$?
[ $rc -eq 3 ] && [ "$(wc -l <"$W/err")" -eq 1 ] ||
    die "inspect to a closed pipe: exit $rc, expected 3 and one line ($(cat "$W/err"))"
rm -rf qp qref

[ "$(fingerprint | grep -v ' ./q/')" = "$(echo "$before" | grep -v ' ./q/')" ] || die "inputs changed"
exit $fail
