#!/usr/bin/env bash
# Bring a file larger than one device call may carry (64 MiB of working tree)
# to the GPU host in several calls on the same warm machine.
#
# Here:           scripts/xfer.sh split FILE [PART_MIB]
#   cuts FILE into parts of PART_MIB (default 30: the working tree, ~16 MB, and
#   .debs, 13 MB, travel with every call and count towards the same 64 MiB) under .xfer/1, .xfer/2, ...
#   (git-ignored) with FILE's sha256 and name in .xfer/manifest; prints one
#   carry list per call.
# On the device:  scripts/xfer.sh take
#   (in each call, carrying that call's .xfer/K and .xfer/manifest) moves the
#   carried parts into .xfer-stash/ (git-ignored, so it stays on a warm machine
#   between calls); once every part is there it joins them, checks the sha256
#   and prints the path of the whole file (.xfer-stash/NAME); exit 0 when
#   complete, 2 while parts are missing, 1 on a checksum mismatch.
# The calls must follow each other before the machine goes back (30 s idle).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
split)
    f=${2:?usage: scripts/xfer.sh split FILE [PART_MIB]}
    mib=${3:-30}
    rm -rf .xfer && mkdir -p .xfer
    name=$(basename "$f")
    split -b "${mib}M" -d -a 3 "$f" .xfer/part.
    k=0
    for p in .xfer/part.*; do
        k=$((k + 1))
        mkdir -p ".xfer/$k"
        mv "$p" ".xfer/$k/"
    done
    printf '%s %s %s\n' "$(sha256sum "$f" | cut -d' ' -f1)" "$k" "$name" >.xfer/manifest
    for i in $(seq 1 "$k"); do
        echo "call $i: carry [\".xfer/$i\", \".xfer/manifest\"], command: scripts/xfer.sh take"
    done
    ;;
take)
    read -r sum parts name <.xfer/manifest
    mkdir -p .xfer-stash
    for d in .xfer/*/; do
        [ -d "$d" ] && cp "$d"part.* .xfer-stash/ 2>/dev/null || true
    done
    have=$(ls .xfer-stash/part.* 2>/dev/null | wc -l)
    if [ "$have" -lt "$parts" ]; then
        echo "xfer: $have of $parts parts of $name here"
        exit 2
    fi
    cat .xfer-stash/part.* >".xfer-stash/$name"
    if [ "$(sha256sum ".xfer-stash/$name" | cut -d' ' -f1)" != "$sum" ]; then
        echo "xfer: $name: sha256 mismatch"
        exit 1
    fi
    rm -f .xfer-stash/part.*
    echo ".xfer-stash/$name"
    ;;
*)
    echo "usage: scripts/xfer.sh split FILE [PART_MIB] | take" >&2
    exit 1
    ;;
esac
