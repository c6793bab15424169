#!/usr/bin/env bash
# Install what the tests need, build (the CUDA backend is compiled when nvcc
# exists), run the whole test suite, then the CPU suite again under
# AddressSanitizer + UndefinedBehaviorSanitizer, then each libFuzzer target for a
# fixed number of executions. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/common.sh

bk_install_deps
bk_cuda_path

jobs=$(nproc 2>/dev/null || echo 2)

bk_build build
bk_log "meson test (all suites; the cuda suite skips without a GPU)"
meson test -C build --print-errorlogs --num-processes "$jobs"

bk_log "sanitizer build (address,undefined; CPU only)"
bk_build build-asan -Dcuda=disabled -Dbuildtype=debug -Db_sanitize=address,undefined -Db_lundef=false
bk_log "meson test under sanitizers (suite cpu)"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    meson test -C build-asan --suite cpu --no-suite slow --print-errorlogs --num-processes "$jobs" \
    --timeout-multiplier 4

bk_log "fuzz targets: 5000 executions each (clang, libFuzzer, ASan + UBSan; docs/FUZZING.md)"
scripts/fuzz.sh --runs 5000

bk_log "all tests passed"
