#!/usr/bin/env python3
"""Reference data produced by the Python `safetensors` package, for the C tests.

Writes, under tests/data/st_python/:
  all_dtypes.safetensors  a file written by safetensors.serialize (every dtype the
                          package can write, a scalar, zero-sized tensors, metadata);
  reference.txt           what the package reads back from that file and from the
                          tiny models in tests/data/models/ (header size, dtype, shape,
                          data offsets, and selected element bit patterns).

Nothing here uses bakron: the C tests compare bakron's reader against this output.
Run from the repository root:  python3 scripts/st_python_reference.py
"""
import ctypes
import json
import os
import struct
import sys

import safetensors
from safetensors import TensorSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "st_python")

# (name, package dtype, shape, bytes per element or None for packed F4)
SPECS = [
    ("t_bool", "bool", [5], 1),
    ("t_u8", "uint8", [2, 3], 1),
    ("t_i8", "int8", [7], 1),
    ("t_i16", "int16", [3, 1], 2),
    ("t_u16", "uint16", [4], 2),
    ("t_f16", "float16", [2, 2], 2),
    ("t_bf16", "bfloat16", [3], 2),
    ("t_i32", "int32", [2, 1, 2], 4),
    ("t_u32", "uint32", [1], 4),
    ("t_f32", "float32", [2, 3], 4),
    ("t_f64", "float64", [2], 8),
    ("t_i64", "int64", [3], 8),
    ("t_u64", "uint64", [2], 8),
    ("t_c64", "complex64", [2], 8),
    ("t_f8_e5m2", "float8_e5m2", [4], 1),
    ("t_f8_e4m3", "float8_e4m3fn", [4], 1),
    ("t_f8_e8m0", "float8_e8m0fnu", [3], 1),
    ("t_f8_e4m3fnuz", "float8_e4m3fnuz", [2], 1),
    ("t_f8_e5m2fnuz", "float8_e5m2fnuz", [2], 1),
    ("t_f4", "float4_e2m1fn_x2", [2, 3], None),  # storage shape: 2 x 3 bytes = 2 x 6 values
    ("scalar_f32", "float32", [], 4),
    ("zero_f32", "float32", [0, 4], 4),
    ("zero_bf16", "bfloat16", [3, 0], 2),
]
METADATA = {"format": "pt", "source": "python safetensors", "note": "ünïcödé ✓"}


def pattern(i, nbytes):
    return bytes(((i * 37 + k * 11 + 5) & 0xFF) for k in range(nbytes))


def make_all_dtypes(path):
    bufs, specs = [], {}
    for i, (name, dt, shape, esz) in enumerate(SPECS):
        n = 1
        for d in shape:
            n *= d
        nbytes = n * esz if esz else n
        data = pattern(i, nbytes)
        if dt == "bool":
            data = bytes(b & 1 for b in data)
        buf = ctypes.create_string_buffer(data, max(nbytes, 1))
        bufs.append(buf)
        specs[name] = TensorSpec(dtype=dt, shape=shape, data_ptr=ctypes.addressof(buf),
                                 data_len=nbytes)
    blob = safetensors.serialize(specs, METADATA)
    with open(path, "wb") as f:
        f.write(blob)


def describe(path, rel, out, pick):
    """Header facts as the package reads them, plus chosen element bit patterns."""
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    tensors = dict(safetensors.deserialize(blob))  # name -> {dtype, shape, data}
    meta = header.get("__metadata__") or {}
    out.append(f"file {rel} {n} {len(tensors)} {len(meta)}")
    for k in sorted(meta):
        out.append(f"meta {json.dumps(k, ensure_ascii=True)} {json.dumps(meta[k], ensure_ascii=True)}")
    for name in sorted(tensors):
        t = tensors[name]
        b, e = header[name]["data_offsets"]
        shape = ",".join(str(d) for d in t["shape"]) or "-"
        out.append(f"tensor {name} {header[name]['dtype']} {shape} {b} {e}")
        data = bytes(t["data"])
        for idx in pick(name, data, header[name]["dtype"]):
            dt = header[name]["dtype"]
            if dt == "F32":
                bits = struct.unpack_from("<I", data, 4 * idx)[0]
                out.append(f"f32 {idx} {bits:08x}")
            elif dt == "BF16":
                bits = struct.unpack_from("<H", data, 2 * idx)[0]
                out.append(f"bf16 {idx} {bits:04x}")
        if pick is pick_all_bytes:
            out.append(f"bytes {data.hex() or '-'}")


def pick_all_bytes(name, data, dt):
    return []


def pick_some(name, data, dt):
    esz = 4 if dt == "F32" else 2
    n = len(data) // esz
    if n == 0:
        return []
    return sorted({0, 1, n // 3, n // 2, n - 1})


def main():
    os.makedirs(OUT, exist_ok=True)
    make_all_dtypes(os.path.join(OUT, "all_dtypes.safetensors"))
    out = [f"# Produced by the Python safetensors package {safetensors.__version__} "
           f"(scripts/st_python_reference.py); do not edit by hand.",
           "# file REL N TENSORS META | meta KEY VALUE | tensor NAME DTYPE SHAPE BEGIN END |"
           " f32/bf16 FLAT_INDEX HEXBITS | bytes HEX"]
    describe(os.path.join(OUT, "all_dtypes.safetensors"), "st_python/all_dtypes.safetensors",
             out, pick_all_bytes)
    models = os.path.join(ROOT, "tests", "data", "models")
    for rel in ["tiny-qwen3/model.safetensors", "tiny-qwen3-bf16/model.safetensors",
                "tiny-qwen2/model.safetensors", "tiny-llama3/model-00001-of-00010.safetensors",
                "tiny-llama3/model-00007-of-00010.safetensors"]:
        describe(os.path.join(models, rel), "models/" + rel, out, pick_some)
    with open(os.path.join(OUT, "reference.txt"), "w") as f:
        f.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
