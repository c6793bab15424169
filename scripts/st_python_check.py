#!/usr/bin/env python3
"""Describe a safetensors file, or a sharded checkpoint folder, as the Python
`safetensors` package reads it. Used by tests/test_st_writer.c to check that what
bakron writes is read back by the reference implementation.

Output, one line each, sorted: `meta KEY VALUE` (JSON strings) then
`tensor NAME DTYPE SHAPE HEXDATA` (SHAPE comma-separated or '-', HEXDATA or '-').
Exits 77 (skip) when the package is not installed.
"""
import json
import os
import sys

try:
    import safetensors
except ImportError:
    sys.exit(77)


def describe_file(path, out):
    with open(path, "rb") as f:
        blob = f.read()
    # the package's own loader validates the file; deserialize gives raw bytes of every dtype
    with safetensors.safe_open(path, framework="numpy") as h:
        meta = h.metadata() or {}
    for k, v in meta.items():
        out.append("meta %s %s" % (json.dumps(k), json.dumps(v)))
    for name, t in safetensors.deserialize(blob):
        shape = ",".join(str(d) for d in t["shape"]) or "-"
        data = bytes(t["data"]).hex() or "-"
        out.append("tensor %s %s %s %s" % (name, t["dtype"], shape, data))


def main():
    path = sys.argv[1]
    out = []
    if os.path.isdir(path):
        base = sys.argv[2]
        with open(os.path.join(path, base + ".safetensors.index.json")) as f:
            index = json.load(f)
        for shard in sorted(set(index["weight_map"].values())):
            describe_file(os.path.join(path, shard), out)
        out = sorted(set(out))
        out.append("total_size %d" % index["metadata"]["total_size"])
    else:
        describe_file(path, out)
        out.sort()
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
