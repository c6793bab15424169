#!/usr/bin/env bash
# Run every libFuzzer target (tests/fuzz/, docs/FUZZING.md) for SECONDS each
# (default 60), one after the other, and print executions and coverage per
# target. Builds build-fuzz with clang (-Dfuzzing=true, ASan + UBSan).
#   scripts/fuzz.sh [SECONDS]         time per target
#   scripts/fuzz.sh --runs N          N executions per target (what CI runs)
#   scripts/fuzz.sh 600 tokens config only the named targets
# New inputs go to build-fuzz/corpus/TARGET (the seed corpus in tests/fuzz is
# not modified); a finding leaves crash-*/leak-*/timeout-* in build-fuzz/findings/
# and makes the script exit 1.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/common.sh

limit=(-max_total_time="${1:-60}")
[ $# -gt 0 ] && shift
if [ "${limit[0]}" = "-max_total_time=--runs" ]; then
    limit=(-runs="${1:?--runs N}")
    shift
fi
all=(safetensors config index tokens preset actdump)
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")
for t in "${targets[@]}"; do
    case " ${all[*]} " in *" $t "*) ;; *) echo "fuzz.sh: no target '$t' (targets: ${all[*]})" >&2; exit 1 ;; esac
done
command -v clang >/dev/null || { echo "fuzz.sh: needs clang and libclang-rt-14-dev (scripts/lib/common.sh installs them)" >&2; exit 1; }
export CC=clang
if [ ! -f build-fuzz/build.ninja ]; then
    bk_log "meson setup build-fuzz (clang, -Dfuzzing=true)"
    meson setup build-fuzz -Dcuda=disabled -Dfuzzing=true -Dbuildtype=debugoptimized >/dev/null
fi
bk_log "building the fuzz targets"
ninja -C build-fuzz $(printf 'tests/fuzz_%s ' "${targets[@]}") >/dev/null

corpus_of() { # the seed corpus folder(s) of a target
    case $1 in
    safetensors) echo tests/fuzz/corpus ;;
    *) echo "tests/fuzz/corpus-$1" ;;
    esac
}
mkdir -p build-fuzz/findings
status=0
printf '%-12s %12s %8s %8s %s\n' target executions cov ft result
for t in "${targets[@]}"; do
    work="build-fuzz/corpus/$t"
    mkdir -p "$work"
    dict=()
    [ -f "tests/fuzz/$t.dict" ] && dict=(-dict="tests/fuzz/$t.dict")
    log="build-fuzz/findings/$t.log"
    rc=0
    nice build-fuzz/tests/fuzz_"$t" "${limit[@]}" "${dict[@]}" -max_len=65536 -timeout=30 \
        -rss_limit_mb=2048 -artifact_prefix="build-fuzz/findings/$t-" -print_final_stats=1 \
        "$work" $(corpus_of "$t") >"$log" 2>&1 || rc=$?
    # the last status line: "#N  DONE  cov: C ft: F ..." (or the last progress line)
    last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
    execs=$(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}' || true)
    [ -n "$execs" ] || execs=$(sed -E 's/^#([0-9]+).*/\1/' <<<"$last")
    cov=$(sed -nE 's/.*cov: ([0-9]+).*/\1/p' <<<"$last")
    ft=$(sed -nE 's/.*ft: ([0-9]+).*/\1/p' <<<"$last")
    result=ok
    if [ $rc -ne 0 ]; then
        result="FINDING (exit $rc, see $log)"
        status=1
    fi
    printf '%-12s %12s %8s %8s %s\n' "$t" "${execs:-?}" "${cov:-?}" "${ft:-?}" "$result"
done
exit $status
