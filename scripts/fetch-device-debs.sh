#!/usr/bin/env bash
# On a connected Debian 12 machine: download the Debian packages that an
# offline GPU host lacks into .debs/ (git-ignored), to be carried there and
# unpacked by scripts/device-env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .debs
cd .debs
apt-get download libcjson1 libcjson-dev libcmocka0 libcmocka-dev libopenblas0-pthread \
    libopenblas-pthread-dev libopenblas-dev libopenblas0 liblapacke liblapacke-dev libgfortran5 \
    libpcre2-8-0 libpcre2-dev libutf8proc2 libutf8proc-dev
ls -l
