#!/usr/bin/env bash
# scripts/quickstart.sh's choices, with the tools it calls replaced by stubs
# that record their arguments (the real build and job are tested elsewhere):
# without a GPU it builds the CPU-only configuration and says so, with one the
# CUDA configuration; the build's progress is visible (ninja's output is not
# hidden); the first line comes before the build. Test 'quickstart' (cpu).
set -u
: "${BK_SOURCE_ROOT:?}"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/bk_quickstart.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $label: $*" >&2; failures=$((failures + 1)); }

setup() { # a copy of the scripts, stub tools on PATH
    rm -rf "$tmp/repo" "$tmp/bin" "$tmp/calls"
    mkdir -p "$tmp/repo/scripts/lib" "$tmp/repo/examples" "$tmp/bin"
    cp "$BK_SOURCE_ROOT/scripts/quickstart.sh" "$tmp/repo/scripts/"
    cp "$BK_SOURCE_ROOT/scripts/lib/common.sh" "$tmp/repo/scripts/lib/"
    mkdir -p "$tmp/repo/examples/kerneldocs-1.6m"
    for t in meson ninja dpkg-query bakron; do
        cat >"$tmp/bin/$t" <<STUB
#!/usr/bin/env bash
echo "$t \$*" >>"$tmp/calls"
case "$t" in
    dpkg-query) echo "install ok installed" ;;
    ninja) echo "[1/2] Compiling C object stub.o"; echo "[2/2] Linking target bakron"
           d=\$2; mkdir -p "$tmp/repo/\$d"; cp "$tmp/bin/bakron" "$tmp/repo/\$d/bakron" ;;
    bakron) [ "\$1" = eval ] && echo "perplexity  1.0" ;;
esac
exit 0
STUB
        chmod +x "$tmp/bin/$t"
    done
}
run_qs() {
    (cd "$tmp/repo" && PATH="$tmp/bin:/usr/bin:/bin" bash scripts/quickstart.sh >"$tmp/out" 2>&1)
    rc=$?
}

label="no GPU: the CPU-only configuration, said so"
setup
printf '#!/bin/sh\nexit 9\n' >"$tmp/bin/nvidia-smi"; chmod +x "$tmp/bin/nvidia-smi"
run_qs
[ "$rc" -eq 0 ] || fail "exit $rc: $(tail -5 "$tmp/out")"
grep -q "no GPU found: building the CPU-only configuration in build-cpu (-Dcuda=disabled)" "$tmp/out" ||
    fail "no message: $(head -5 "$tmp/out")"
grep -q "^meson setup build-cpu -Dcuda=disabled" "$tmp/calls" || fail "meson: $(grep meson "$tmp/calls")"
grep -q "^\[2/2\] Linking target bakron" "$tmp/out" || fail "the build's progress is hidden"
grep -q "^bakron quantize examples/kerneldocs-1.6m" "$tmp/calls" || fail "the job did not run: $(cat "$tmp/calls")"
head -1 "$tmp/out" | grep -q "^==> " || fail "first line: $(head -1 "$tmp/out")"

label="a GPU: the CUDA configuration"
setup
printf '#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-x)"\n' >"$tmp/bin/nvidia-smi"; chmod +x "$tmp/bin/nvidia-smi"
run_qs
[ "$rc" -eq 0 ] || fail "exit $rc: $(tail -5 "$tmp/out")"
grep -q "GPU found" "$tmp/out" || fail "no message"
grep -q "^meson setup build$" "$tmp/calls" || fail "meson: $(grep meson "$tmp/calls")"

echo "quickstart: $failures failure(s)"
[ "$failures" -eq 0 ]
