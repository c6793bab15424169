"""A minimal, independent safetensors reader for the shell tests: the header
as parsed JSON and the raw data section (no validation: the files come from
the code under test, whose own reader is tested elsewhere)."""
import json
import struct


def read(path):
    """(header dict, data bytes) of one .safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), f.read()


def tensor(h, data, name):
    """(header entry, bytes) of one tensor."""
    t = h[name]
    a, b = t["data_offsets"]
    return t, data[a:b]
