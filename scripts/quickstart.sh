#!/usr/bin/env bash
# Install what bakron needs, build it, and run the main job on the bundled
# example model (examples/kerneldocs-1.6m).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/common.sh

bk_install_deps
bk_cuda_path
bk_build build

model=examples/kerneldocs-1.6m
bk_log "bakron inspect $model"
./build/bakron inspect "$model"
