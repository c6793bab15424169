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
# Open MPI (MPI ranks, docs/DISTRIBUTED.md): the library, mpirun, headers and their
# run-time dependencies (device-env.sh relocates them with OPAL_PREFIX)
apt-get download libopenmpi3 libopenmpi-dev openmpi-bin openmpi-common libpmix2 \
    libevent-core-2.1-7 libevent-pthreads-2.1-7 libfabric1 libhwloc15 libhwloc-plugins \
    libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200 libpsm-infinipath1 libpsm2-2 libucx0 \
    libmunge2 libnuma1 libpciaccess0
ls -l
