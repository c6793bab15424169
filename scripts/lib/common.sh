# Shared by scripts/*.sh: dependency installation and the build.
# shellcheck shell=bash

BK_DEBIAN_PACKAGES="meson ninja-build pkg-config gcc python3 libcjson-dev libzstd-dev libcmocka-dev libopenblas-dev liblapacke-dev libpcre2-dev libutf8proc-dev"
# the fuzz targets (scripts/fuzz.sh, docs/FUZZING.md): clang and libFuzzer's
# runtime (libclang_rt.fuzzer, Debian 12: libclang-rt-14-dev)
BK_DEBIAN_PACKAGES="$BK_DEBIAN_PACKAGES clang libclang-rt-14-dev"
# libopenmpi-dev + openmpi-bin: MPI ranks (optional at build time; tests/test_mpi.sh needs them)
BK_DEBIAN_PACKAGES="$BK_DEBIAN_PACKAGES libopenmpi-dev openmpi-bin"

bk_log() { printf '==> %s\n' "$*" >&2; }

# Install the Debian packages that are missing (apt-get; sudo when not root).
bk_install_deps() {
    local missing=() p
    for p in $BK_DEBIAN_PACKAGES "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        bk_log "Debian packages: all present"
        return 0
    fi
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || { echo "need root or sudo to install: ${missing[*]}" >&2; return 1; }
        sudo="sudo"
    fi
    bk_log "installing Debian packages: ${missing[*]}"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Put nvcc on PATH when the CUDA toolkit is installed in the usual place.
bk_cuda_path() {
    if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
        export PATH="/usr/local/cuda/bin:$PATH"
    fi
    if command -v nvcc >/dev/null 2>&1; then
        bk_log "nvcc: $(command -v nvcc) (CUDA backend will be compiled)"
    else
        bk_log "nvcc not found: building without the CUDA backend"
    fi
}

# bk_build DIR [meson options...]: configure (once) and build.
bk_build() {
    local dir=$1; shift
    if [ -f "$dir/build.ninja" ]; then
        meson configure "$dir" "$@" >/dev/null
    else
        bk_log "meson setup $dir $*"
        meson setup "$dir" "$@" >/dev/null
    fi
    bk_log "building in $dir (ninja prints [done/total] per step)"
    ninja -C "$dir"
}

# 1 when an NVIDIA GPU answers (nvidia-smi lists one), else 0.
bk_have_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}
