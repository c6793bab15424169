#!/usr/bin/env bash
# --resume (issue 14; backprop kinds: issue 16): a quantize run killed at any point (kill -9 at random
# times, deterministic fault points before/after a layer's journal line and
# inside a layer, SIGINT) and then continued with --resume writes exactly the
# bytes of an uninterrupted run (report.json: times aside); a resume with other
# arguments, a changed model or other calibration is refused with one line
# naming what differs, and leaves the work folder for the right command.
# The bundled example model, a few short sequences (fast).
set -u
source "${BK_SOURCE_ROOT:?}/tests/common.sh" # B, SRC, M, W, die
cp -r "$SRC/examples/kerneldocs-1.6m" "$W/m"
cp "$W/m/calib.safetensors" "$W/c.safetensors"
cd "$W" || exit 1
export OPENBLAS_NUM_THREADS=1 # (many short runs)
CAL=(--calib c.safetensors --samples 4 --seqlen 32 --backend cpu)

# same DIR REF: the same files, byte for byte; report.json without its times and
# the host memory found at the start (backprop.host_*, planned_host_weight_copies_bytes)
same() {
    [ -d "$1" ] || { echo "missing $1"; return 1; }
    [ "$(cd "$1" && ls -A)" = "$(cd "$2" && ls -A)" ] ||
        { echo "files: $(cd "$1" && ls -A | tr '\n' ' ') vs $(cd "$2" && ls -A | tr '\n' ' ')"; return 1; }
    for f in $(cd "$2" && ls -A); do
        if [ "$f" = report.json ]; then
            python3 - "$1/$f" "$2/$f" <<'EOF' || return 1
import json, sys
def strip(x):
    if isinstance(x, dict):
        # (times; and what depends on the host's free memory at the start)
        return {k: strip(v) for k, v in x.items() if not k.endswith("_s") and
                k not in ("host_available_bytes_at_plan", "host_weight_copies_budget_bytes",
                          "planned_host_weight_copies_bytes")}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x
a, b = (strip(json.load(open(p))) for p in sys.argv[1:3])
if a != b:
    print("report.json differs"); sys.exit(1)
EOF
        else
            cmp -s "$1/$f" "$2/$f" || { echo "$f differs"; return 1; }
        fi
    done
}
clean() { # no work folder, lock or resume state left
    ls -A | grep -q -E '\.(tmp|old)-|\.lock$' && { echo "left: $(ls -A | tr '\n' ' ')"; return 1; }
    [ -e q/.resume ] && { echo "q/.resume left"; return 1; }
    return 0
}

# resume_until_done NAME ARGS...: --resume until the run exits 0 (at most 4 times)
resume_until_done() {
    local name=$1; shift
    for _ in 1 2 3 4; do
        "$B" quantize m "$@" --out q --resume >/dev/null 2>err && return 0
        local rc=$?
        [ $rc -eq 137 ] || [ $rc -eq 3 ] || { die "$name: resume exit $rc: $(tail -1 err)"; return 1; }
    done
    die "$name: never finished"
}

check() { # name ref
    local why
    why=$(same q "$2") || die "$1: output differs from the uninterrupted run: $why"
    why=$(clean) || die "$1: $why"
    rm -rf q
}

configs=(
    "gptq native|--hessian gptq --levels 3 ${CAL[*]}"
    "mlplocal-kfac gptq-export sharded|--hessian mlplocal-kfac --bits 4 --group 64 --export gptq --max-shard-size 300000 ${CAL[*]}"
    "fullylocal-shampoo dequantized layers 1:3|--hessian fullylocal-shampoo --export dequantized --layers 1:3 --batch 2 ${CAL[*]}"
    "mlplocal-kfac no-sequential asym|--hessian mlplocal-kfac --bits 3 --asym --no-sequential ${CAL[*]}"
    "rtn no calibration|--hessian rtn --levels 2"
    "backprop-kfac|--hessian backprop-kfac --levels 3 ${CAL[*]}"
    "backprop-shampoo leaf 2 empirical|--hessian backprop-shampoo --leaf-size 2 --fisher empirical --levels 3 ${CAL[*]}"
)
"$B" dump-activations m --calib c.safetensors --samples 4 --seqlen 32 --backend cpu --out acts \
    2>err >/dev/null || die "dump-activations: $(cat err)"
configs+=("activations|--hessian mlplocal-kfac --levels 3 --activations acts --backend cpu")

n=0
for c in "${configs[@]}"; do
    name=${c%%|*}
    read -r -a args <<<"${c#*|}"
    n=$((n + 1))
    ref=ref$n
    "$B" quantize m "${args[@]}" --out $ref 2>err >/dev/null || { die "$name: reference: $(cat err)"; continue; }
    # deterministic points: before / after a journal line, inside a layer (all
    # of them for the first configuration)
    points="module-9"
    [ $n -eq 1 ] && points="journal-1 journal-after-1 journal-3 journal-after-4 module-2 module-9 module-20"
    for pt in $points; do
        case "$name" in rtn*) case $pt in module-*) pt=journal-2 ;; esac ;; esac
        BK_FAULT_KILL_AT=$pt "$B" quantize m "${args[@]}" --out q >/dev/null 2>err
        rc=$?
        if [ $rc -ne 137 ]; then
            # a point the run does not reach (fewer layers) finishes it
            [ $rc -eq 0 ] || die "$name $pt: exit $rc: $(tail -1 err)"
        else
            # the saved modules are codes and scales: the weights rebuilt from them
            # were the solver's (else the module file carries a float copy)
            if [ $pt = module-9 ]; then
                for f in q.tmp-*/.resume/L*.safetensors; do
                    [ -e "$f" ] || continue
                    "$B" inspect "$f" 2>&1 | grep -q "^ *weight " && die "$name: $f needed a float copy"
                done
            fi
            resume_until_done "$name $pt" "${args[@]}"
            grep -q -E "layers? .*kept|continuing|no interrupted run|starting from" err ||
                die "$name $pt: no resume message: $(cat err)"
        fi
        check "$name $pt" $ref
    done
    # killed again while resuming: journal-2, then journal-4 in the resumed run
    [ $n -le 2 ] || continue
    BK_FAULT_KILL_AT=journal-2 "$B" quantize m "${args[@]}" --out q >/dev/null 2>&1
    BK_FAULT_KILL_AT=journal-4 "$B" quantize m "${args[@]}" --out q --resume >/dev/null 2>&1
    resume_until_done "$name twice" "${args[@]}"
    check "$name killed twice" $ref
done

# --- module files: only where the shards do not hold the codes ------------
# native export (levels, uniform symmetric/asymmetric with groups): the codes,
# scales and zeros are read back from the shards, no module file is written;
# --export gptq (F16 scales) and dequantized keep them. Expected bytes: the
# uninterrupted runs (ref1 for levels, new references for the uniform kinds).
# files_at NAME ARGS...: killed after the 2nd journal line; nfiles = the module files then
files_at() {
    local name=$1; shift
    rm -rf q q.tmp-*
    BK_FAULT_KILL_AT=journal-after-2 "$B" quantize m "$@" --out q >/dev/null 2>&1
    [ $? -eq 137 ] || { die "$name: journal-after-2 not reached"; return; }
    [ "$(grep -c . q.tmp-*/.resume/journal)" -eq 2 ] || die "$name: not two journal lines"
    nfiles=$(ls q.tmp-*/.resume | grep -c '^L.*\.safetensors$')
}
read -r -a args <<<"${configs[0]#*|}"
files_at "levels native" "${args[@]}"
[ "$nfiles" -eq 0 ] || die "levels native: $nfiles module files"
resume_until_done "levels native files" "${args[@]}"
check "levels native, no module files" ref1
read -r -a gargs <<<"${configs[1]#*|}"
files_at "gptq export" "${gargs[@]}"
[ "$nfiles" -ge 14 ] || die "gptq export: $nfiles module files, expected 7 per journaled layer"
resume_until_done "gptq export files" "${gargs[@]}"
check "gptq export, module files" ref2
dargs=(--hessian gptq --levels 3 --export dequantized "${CAL[@]}")
"$B" quantize m "${dargs[@]}" --out refd 2>err >/dev/null || die "dequantized reference: $(cat err)"
files_at "dequantized" "${dargs[@]}"
[ "$nfiles" -ge 14 ] || die "dequantized: $nfiles module files, expected 7 per journaled layer"
resume_until_done "dequantized files" "${dargs[@]}"
check "dequantized, module files" refd
for c in "uniform sym grouped|--hessian gptq --bits 4 --group 64 ${CAL[*]}" \
    "uniform asym grouped|--hessian mlplocal-kfac --bits 3 --group 32 --asym ${CAL[*]}" \
    "uniform 8 bits asym|--hessian gptq --bits 8 --asym ${CAL[*]}"; do
    name=${c%%|*}
    read -r -a uargs <<<"${c#*|}"
    "$B" quantize m "${uargs[@]}" --out refu 2>err >/dev/null || { die "$name: reference: $(cat err)"; continue; }
    files_at "$name" "${uargs[@]}"
    [ "$nfiles" -eq 0 ] || die "$name: $nfiles module files"
    resume_until_done "$name files" "${uargs[@]}"
    check "$name, no module files" refu
    for pt in module-3 module-10 journal-3 journal-after-1 journal-after-3; do
        BK_FAULT_KILL_AT=$pt "$B" quantize m "${uargs[@]}" --out q >/dev/null 2>err
        rc=$?
        [ $rc -eq 137 ] || [ $rc -eq 0 ] || die "$name $pt: exit $rc: $(tail -1 err)"
        [ $rc -eq 137 ] && resume_until_done "$name $pt" "${uargs[@]}"
        check "$name $pt" refu
    done
    rm -rf refu
done
# a changed byte of a journaled layer's codes in the shards: the digest notices,
# the layers from there on are redone, the bytes are the uninterrupted run's
read -r -a args <<<"${configs[0]#*|}"
files_at "corrupted codes" "${args[@]}"
python3 - q.tmp-*/model.safetensors.partial <<'EOF' || die "corrupting the shard failed"
import json, struct, sys
with open(sys.argv[1], "r+b") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    t = json.loads(f.read(n))["model.layers.1.mlp.up_proj.qweight"]
    f.seek(8 + n + t["data_offsets"][0] + 5)
    b = f.read(1)[0]
    f.seek(8 + n + t["data_offsets"][0] + 5)
    f.write(bytes([(b + 1) % 256]))
EOF
"$B" quantize m "${args[@]}" --out q --resume >/dev/null 2>err || die "corrupted codes: $(tail -1 err)"
grep -q "layer 1's tensors in the shards differ from the journal's digest; continuing from layer 1" err ||
    die "corrupted codes: not noticed: $(cat err)"
check "corrupted codes" ref1
# a journal line without "files" (every module had a file) and no files: redone
files_at "old journal" "${args[@]}"
sed -i 's/,"files":\[\]//' q.tmp-*/.resume/journal
"$B" quantize m "${args[@]}" --out q --resume >/dev/null 2>err || die "old journal: $(tail -1 err)"
grep -q "layer 0's saved codes are missing; continuing from layer 0" err ||
    die "old journal: missing module files not noticed: $(cat err)"
check "old journal" ref1
# a module file the journal names, removed: redone from that layer
files_at "gptq export, a module file removed" "${gargs[@]}"
rm q.tmp-*/.resume/L00001.mlp.down_proj.safetensors
"$B" quantize m "${gargs[@]}" --out q --resume >/dev/null 2>err || die "removed module file: $(tail -1 err)"
grep -q "layer 1's saved codes are missing; continuing from layer 1" err ||
    die "removed module file: not noticed: $(cat err)"
check "gptq export, a module file removed" ref2

# random kill -9 times (gptq native), each followed by --resume
read -r -a args <<<"${configs[0]#*|}"
"$B" quantize m "${args[@]}" --out q 2>/dev/null >/dev/null # warm-up: how long a run takes
for i in 1 2 3 4 5; do
    "$B" quantize m "${args[@]}" --out q >/dev/null 2>&1 &
    pid=$!
    sleep "$((RANDOM % 2)).$((RANDOM % 10))$((RANDOM % 10))"
    kill -9 $pid 2>/dev/null
    wait $pid 2>/dev/null
    if [ -d q ] && ! ls -A | grep -q 'q\.tmp-'; then
        # finished before the kill; a kill between the commit and the lock's
        # removal leaves the lock (the next run clears it with a note)
        rm -f .q.lock
    else
        resume_until_done "random kill $i" "${args[@]}"
    fi
    check "random kill $i" ref1
done

# interrupt_at PATTERN OUT ARGS...: quantize m into OUT in the background
# (stderr to err), SIGINT once PATTERN shows in err; rc: its exit status
interrupt_at() {
    local pattern=$1 out=$2 pid
    shift 2
    "$B" quantize m "$@" --out "$out" >/dev/null 2>err &
    pid=$!
    for _ in $(seq 1200); do grep -q "$pattern" err && break; sleep 0.05; done
    kill -INT $pid
    wait $pid
    rc=$?
}

# SIGINT: exit 3, the work folder kept with a message, --resume finishes it
interrupt_at "done (2/4)" q "${args[@]}"
if [ $rc -eq 0 ]; then
    echo "SIGINT came after the end (not tested this time)"
else
    [ $rc -eq 3 ] || die "SIGINT: exit $rc"
    grep -q "with --resume continues" err || die "SIGINT: no hint at --resume: $(cat err)"
    ls -A | grep -q 'q\.tmp-' || die "SIGINT: the work folder was not kept"
    resume_until_done "SIGINT" "${args[@]}"
fi
check "SIGINT" ref1

# SIGINT inside the backprop flow: the pass stops at its next micro-batch (a pass can
# take minutes at scale) with exit 3 and a line naming the pass, not after the flow
bpi=(--calib c.safetensors --samples 16 --seqlen 64 --backend cpu --hessian backprop-kfac --levels 3)
rm -rf qb
interrupt_at "backward pass 1 " qb "${bpi[@]}"
[ $rc -eq 3 ] || die "SIGINT in the flow: exit $rc: $(tail -1 err)"
grep -q "error: interrupted in backward pass [0-9]* (layers [0-9]*-[0-9]*)" err ||
    die "SIGINT in the flow: not stopped inside the flow: $(tail -1 err)"
"$B" quantize m "${bpi[@]}" --out qb --resume >/dev/null 2>err || die "resume after SIGINT in the flow: $(tail -1 err)"
[ -f qb/report.json ] || die "resume after SIGINT in the flow: no output"
rm -rf qb

# --- refusals: other arguments, model or calibration ----------------------
BK_FAULT_KILL_AT=journal-3 "$B" quantize m "${args[@]}" --out q >/dev/null 2>&1
refused() { # why rc what args...
    local why=$1 want=$2 what=$3; shift 3
    "$B" quantize m "$@" --out q --resume >/dev/null 2>err
    local rc=$?
    [ $rc -eq "$want" ] || die "$why: exit $rc, expected $want: $(cat err)"
    # (a kill -9 leaves its lock file: the note about clearing it aside)
    [ "$(grep -v "cleared a stale lock" err | grep -c .)" -eq 1 ] || die "$why: not one line: $(cat err)"
    grep -q -- "$what" err || die "$why: does not name $what: $(cat err)"
    ls -A | grep -q 'q\.tmp-' || die "$why: the work folder is gone"
    [ -d q ] && die "$why: an output appeared"
    echo "refused ($why): $(grep -v "stale lock" err | cut -c1-160)"
}
refused "other levels" 1 "--levels" --hessian gptq --levels 2 "${CAL[@]}"
refused "other hessian" 1 "--hessian" --hessian mlplocal-kfac --levels 3 "${CAL[@]}"
refused "other samples" 1 "sequences" --hessian gptq --levels 3 --calib c.safetensors --samples 3 \
    --seqlen 32 --backend cpu
refused "other export" 1 "--export" --hessian gptq --levels 3 --export dequantized "${CAL[@]}"
touch -r m/model.safetensors stamp
touch -d '2001-01-01' m/model.safetensors
refused "model changed" 2 "model.safetensors" "${args[@]}"
touch -r stamp m/model.safetensors
cp c.safetensors c.keep
cp m/eval.safetensors c.safetensors
refused "calibration changed" 2 "calibration" "${args[@]}"
cp c.keep c.safetensors
refused "other hessian (backprop)" 1 "--hessian" --hessian backprop-kfac --levels 3 "${CAL[@]}"
# the right command continues
resume_until_done "after refusals" "${args[@]}"
check "after refusals" ref1
# backprop kinds: the flow's arguments belong to the run too
read -r -a bargs <<<"${configs[5]#*|}"
BK_FAULT_KILL_AT=journal-2 "$B" quantize m "${bargs[@]}" --out q >/dev/null 2>&1
refused "other --seed (backprop)" 1 "--seed" "${bargs[@]}" --seed 1
refused "other --fisher (backprop)" 1 "--fisher" "${bargs[@]}" --fisher empirical
# the leaf as run: the default (0, chosen: 1 on the CPU) is --leaf-size 1, not 2
refused "other --leaf-size (backprop)" 1 "--leaf-size" "${bargs[@]}" --leaf-size 2
resume_until_done "backprop after refusals" "${bargs[@]}" --leaf-size 1
check "backprop after refusals" ref6
# --bwd-precision is compared as resolved (auto, the default since session 16:
# fp32 on the CPU): a killed bf16 run is continued neither with auto nor with the
# default; a killed default run is continued with an explicit fp32 (the same
# resolved value) and a killed fp32 run with the default, to the same weights;
# report.json says what the finishing command asked for (precision_auto)
BK_FAULT_KILL_AT=journal-2 "$B" quantize m "${bargs[@]}" --bwd-precision bf16 --out q >/dev/null 2>&1
refused "auto (fp32 here) after bf16 (backprop)" 1 "--bwd-precision was 'bf16', now 'fp32'" \
    "${bargs[@]}" --bwd-precision auto
refused "the default (auto: fp32 here) after bf16 (backprop)" 1 \
    "--bwd-precision was 'bf16', now 'fp32'" "${bargs[@]}"
resume_until_done "bf16 after the auto refusals" "${bargs[@]}" --bwd-precision bf16
rm -rf q
# resumed_as NAME AUTO: q resumed, ref6's weights, report.json's precision fields
resumed_as() {
    grep -q "layers\? .*kept\|continuing" err || die "$1: not resumed: $(cat err)"
    cmp -s q/model.safetensors ref6/model.safetensors || die "$1: other weights than ref6"
    python3 -c "
import json, sys; b = json.load(open('q/report.json'))['backprop']
sys.exit(not (b['precision_auto'] is $2 and b['precision_option'] == 'fp32'))" ||
        die "$1: report.json's backprop precision fields"
    rm -rf q
}
BK_FAULT_KILL_AT=journal-2 "$B" quantize m "${bargs[@]}" --out q >/dev/null 2>&1
resume_until_done "fp32 after the default (backprop)" "${bargs[@]}" --bwd-precision fp32
resumed_as "fp32 after the default" False
BK_FAULT_KILL_AT=journal-2 "$B" quantize m "${bargs[@]}" --bwd-precision fp32 --out q >/dev/null 2>&1
resume_until_done "the default after fp32 (backprop)" "${bargs[@]}"
resumed_as "the default after fp32" True
BK_FAULT_KILL_AT=journal-2 "$B" quantize m "${bargs[@]}" --bwd-precision fp32 --out q >/dev/null 2>&1
resume_until_done "auto after fp32 (backprop)" "${bargs[@]}" --bwd-precision auto
resumed_as "auto after fp32" True

# without --resume a killed run's folder is removed (with a message)
BK_FAULT_KILL_AT=journal-2 "$B" quantize m "${args[@]}" --out q >/dev/null 2>&1
"$B" quantize m "${args[@]}" --out q >/dev/null 2>err || die "without --resume: $(cat err)"
grep -q "would continue; starting over" err && grep -q "left by a killed run" err ||
    die "without --resume: no message: $(cat err)"
check "without --resume" ref1
# --resume with nothing to resume: starts from the first layer
"$B" quantize m "${args[@]}" --out q --resume >/dev/null 2>err || die "nothing to resume: $(cat err)"
grep -q "no interrupted run" err || die "nothing to resume: no message: $(cat err)"
check "nothing to resume" ref1
exit $fail
