#!/usr/bin/env python3
"""Generate the malformed-safetensors corpus used by tests/test_safetensors.c and the
fuzz replay, plus the valid edge-case seeds of the fuzz corpus.

  tests/data/bad/safetensors/  one file per rule of docs/formats.md ("## safetensors")
                               and more: each must be rejected with a specific status
  tests/data/bad/index/CASE/   sharded checkpoints with a broken index or shard
  tests/fuzz/corpus/           valid edge cases (accepted) that seed the fuzzer

Files are built byte by byte here (no safetensors library involved), so the
expectations in the C test table come from this independent construction.
Run from anywhere:  python3 scripts/make_bad_corpus.py
"""
import json
import os
import shutil
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD = os.path.join(ROOT, "tests", "data", "bad", "safetensors")
IDX = os.path.join(ROOT, "tests", "data", "bad", "index")
SEEDS = os.path.join(ROOT, "tests", "fuzz", "corpus")


def image(header, data=b"", n=None):
    """8-byte little-endian N + header bytes + data. `n` overrides N."""
    hb = header.encode("utf-8") if isinstance(header, str) else header
    return struct.pack("<Q", len(hb) if n is None else n) + hb + data


def hjson(obj):
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def good(tensors, meta=None):
    """A valid file from [(name, dtype, shape, bytes)] laid out in order."""
    h, off, data = {}, 0, b""
    if meta is not None:
        h["__metadata__"] = meta
    for name, dt, shape, raw in tensors:
        h[name] = entry(dt, shape, off, off + len(raw))
        off += len(raw)
        data += raw
    return image(hjson(h), data)


F32x2 = struct.pack("<2f", 1.5, -2.0)


def bad_files():
    t = {}
    # rule 1: shorter than 8 bytes
    t["r01_empty.safetensors"] = b""
    t["r01_seven_bytes.safetensors"] = b"\x10\x00\x00\x00\x00\x00\x00"
    # rule 2: N > 100,000,000
    t["r02_header_too_large.safetensors"] = image("{}", n=100_000_001)
    t["r02_header_u64_max.safetensors"] = struct.pack("<Q", 2**64 - 1) + b"{}"
    # rule 3: 8 + N beyond the end of the file
    t["r03_header_past_eof.safetensors"] = image('{"a":{}}', n=4096)
    t["r03_header_one_past.safetensors"] = image("{}  ", n=5)
    # rule 4: header not UTF-8
    t["r04_invalid_byte.safetensors"] = image(b'{"a\xff":' + hjson(entry("F32", [2], 0, 8)).encode() + b"}", F32x2)
    t["r04_overlong.safetensors"] = image(b'{"a\xc0\xaf":' + hjson(entry("F32", [2], 0, 8)).encode() + b"}", F32x2)
    t["r04_surrogate.safetensors"] = image(b'{"a\xed\xa0\x80":' + hjson(entry("F32", [2], 0, 8)).encode() + b"}", F32x2)
    t["r04_cut_sequence.safetensors"] = image(b'{"a":' + hjson(entry("F32", [2], 0, 8)).encode() + b"}\xe2\x82", F32x2)
    # rule 5: not JSON
    t["r05_json_unclosed.safetensors"] = image('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}', F32x2)
    t["r05_json_trailing_garbage.safetensors"] = image(hjson({"a": entry("F32", [2], 0, 8)}) + "x", F32x2)
    t["r05_json_control_char.safetensors"] = image('{"a\x01":' + hjson(entry("F32", [2], 0, 8)) + "}", F32x2)
    t["r05_json_nul_byte.safetensors"] = image(b'{"a":' + hjson(entry("F32", [2], 0, 8)).encode() + b"}\x00", F32x2)
    t["r05_json_single_quotes.safetensors"] = image("{'a':{'dtype':'F32','shape':[2],'data_offsets':[0,8]}}", F32x2)
    t["r05_json_deep_nesting.safetensors"] = image('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":' + "[" * 5000 + "]" * 5000 + "}}", F32x2)
    t["r05_json_empty_header.safetensors"] = image("")
    # rule 5: wrong schema
    t["r05_schema_top_array.safetensors"] = image("[]")
    t["r05_schema_entry_not_object.safetensors"] = image('{"a":3}')
    t["r05_schema_missing_dtype.safetensors"] = image('{"a":{"shape":[2],"data_offsets":[0,8]}}', F32x2)
    t["r05_schema_missing_shape.safetensors"] = image('{"a":{"dtype":"F32","data_offsets":[0,8]}}', F32x2)
    t["r05_schema_missing_offsets.safetensors"] = image('{"a":{"dtype":"F32","shape":[2]}}', F32x2)
    t["r05_schema_dtype_not_string.safetensors"] = image('{"a":{"dtype":9,"shape":[2],"data_offsets":[0,8]}}', F32x2)
    t["r05_schema_duplicate_field.safetensors"] = image('{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', F32x2)
    t["r05_schema_shape_negative.safetensors"] = image(hjson({"a": entry("F32", [-2], 0, 8)}), F32x2)
    t["r05_schema_shape_fraction.safetensors"] = image('{"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,8]}}', F32x2)
    t["r05_schema_shape_huge.safetensors"] = image('{"a":{"dtype":"F32","shape":[1e20],"data_offsets":[0,8]}}', F32x2)
    t["r05_schema_shape_2p53_plus_2.safetensors"] = image('{"a":{"dtype":"U8","shape":[9007199254740994,0],"data_offsets":[0,0]}}')
    t["r05_schema_shape_string.safetensors"] = image('{"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}}', F32x2)
    t["r05_schema_shape_not_array.safetensors"] = image('{"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}}', F32x2)
    t["r05_json_nan_literal.safetensors"] = image('{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,8]}}', F32x2)
    t["r05_schema_offset_negative.safetensors"] = image(hjson({"a": entry("F32", [2], -8, 0)}), F32x2)
    t["r05_schema_offset_fraction.safetensors"] = image('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8.5]}}', F32x2)
    t["r05_schema_offset_huge.safetensors"] = image('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551624]}}', F32x2)
    t["r05_schema_offset_string.safetensors"] = image('{"a":{"dtype":"F32","shape":[2],"data_offsets":["0",8]}}', F32x2)
    t["r05_schema_offsets_three.safetensors"] = image('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}', F32x2)
    t["r05_schema_offsets_one.safetensors"] = image('{"a":{"dtype":"F32","shape":[2],"data_offsets":[8]}}', F32x2)
    t["r05_schema_offsets_object.safetensors"] = image('{"a":{"dtype":"F32","shape":[2],"data_offsets":{"b":0,"e":8}}}', F32x2)
    t["r05_schema_metadata_int.safetensors"] = image(hjson({"__metadata__": {"format": "pt", "step": 3}, "a": entry("F32", [2], 0, 8)}), F32x2)
    t["r05_schema_metadata_nested.safetensors"] = image(hjson({"__metadata__": {"cfg": {"x": "y"}}, "a": entry("F32", [2], 0, 8)}), F32x2)
    t["r05_schema_metadata_string.safetensors"] = image(hjson({"__metadata__": "pt", "a": entry("F32", [2], 0, 8)}), F32x2)
    t["r05_schema_metadata_null_value.safetensors"] = image(hjson({"__metadata__": {"format": None}, "a": entry("F32", [2], 0, 8)}), F32x2)
    # rule 5: unknown dtype
    t["r05_dtype_unknown.safetensors"] = image(hjson({"a": entry("F33", [2], 0, 8)}), F32x2)
    t["r05_dtype_lowercase.safetensors"] = image(hjson({"a": entry("f32", [2], 0, 8)}), F32x2)
    t["r05_dtype_torch_name.safetensors"] = image(hjson({"a": entry("float32", [2], 0, 8)}), F32x2)
    # more dimensions than bakron's BK_MAX_DIMS (8)
    t["limit_nine_dims.safetensors"] = image(hjson({"a": entry("F32", [1] * 9, 0, 4)}), b"\0" * 4)
    # a NUL character in a name (valid JSON, but not representable in C strings)
    t["limit_nul_in_name.safetensors"] = image('{"a\\u0000b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x01")
    # rule 7: layout
    two = struct.pack("<4f", 1, 2, 3, 4)
    t["r07_overlap.safetensors"] = image(hjson({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}), two[:12])
    t["r07_hole.safetensors"] = image(hjson({"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 12, 16)}), two)
    t["r07_first_not_zero.safetensors"] = image(hjson({"a": entry("F32", [2], 8, 16)}), two)
    t["r07_alias.safetensors"] = image(hjson({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 0, 8)}), F32x2)
    t["r07_end_before_begin.safetensors"] = image(hjson({"a": entry("F32", [2], 0, 8), "b": entry("F32", [0], 8, 4)}), F32x2)
    # rule 8: overflow of the element count or the bit count
    t["r08_numel_overflow.safetensors"] = image(hjson({"a": entry("U8", [2**32, 2**32, 2], 0, 0)}))
    t["r08_bits_overflow.safetensors"] = image(hjson({"a": entry("F64", [2**31, 2**30], 0, 0)}))
    # rule 9: sub-byte dtypes must fill whole bytes
    t["r09_f4_odd_count.safetensors"] = image(hjson({"a": entry("F4", [3], 0, 2)}), b"\x12\x34")
    t["r09_f6_three.safetensors"] = image(hjson({"a": entry("F6_E2M3", [3], 0, 3)}), b"\x12\x34\x56")
    # rule 10: data size != element count x dtype size
    t["r10_size_mismatch.safetensors"] = image(hjson({"a": entry("F32", [2], 0, 4)}), b"\0" * 4)
    t["r10_zero_shape_with_bytes.safetensors"] = image(hjson({"a": entry("F32", [0], 0, 4)}), b"\0" * 4)
    t["r10_f4_bytes.safetensors"] = image(hjson({"a": entry("F4", [4], 0, 4)}), b"\0" * 4)
    # rule 11: 8 + N + last end != file size
    full = good([("a", "F32", [2], F32x2), ("b", "F32", [2], F32x2)])
    t["r11_truncated.safetensors"] = full[:-3]
    t["r11_trailing_bytes.safetensors"] = full + b"\0"
    t["r11_no_data.safetensors"] = full[: len(full) - 16]
    # duplicates
    t["dup_tensor_name.safetensors"] = image('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}', F32x2 * 2)
    t["dup_metadata_block.safetensors"] = image('{"__metadata__":{"format":"pt"},"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', F32x2)
    t["dup_metadata_key.safetensors"] = image('{"__metadata__":{"format":"pt","format":"np"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', F32x2)
    return t


def seeds():
    """Valid files: every one must be accepted."""
    s = {}
    s["ok_empty_header.safetensors"] = image("{}")
    s["ok_padded_header.safetensors"] = image("{}      ")
    s["ok_whitespace_around.safetensors"] = image("\n\t " + hjson({"a": entry("F32", [2], 0, 8)}) + " \r\n", F32x2)
    s["ok_extra_keys.safetensors"] = image(hjson({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "extra": [1, {"x": None}]}}), F32x2)
    s["ok_null_metadata.safetensors"] = image(hjson({"__metadata__": None, "a": entry("F32", [2], 0, 8)}), F32x2)
    s["ok_scalar.safetensors"] = good([("s", "F64", [], struct.pack("<d", 3.25))], {"format": "pt"})
    s["ok_zero_sized.safetensors"] = good([("z0", "F32", [0], b""), ("z1", "BF16", [4, 0, 2], b""), ("x", "U8", [1], b"\x07")])
    s["ok_zero_sized_shared_offset.safetensors"] = image(hjson({"a": entry("U8", [0], 0, 0), "b": entry("I32", [0, 5], 0, 0), "c": entry("U8", [2], 0, 2)}), b"\1\2")
    s["ok_opaque_dtypes.safetensors"] = good([("f8", "F8_E4M3", [4], b"\x38\x40\xb8\xc0"), ("f4", "F4", [4], b"\x12\x34"), ("f6", "F6_E3M2", [4], b"\x01\x02\x03"), ("c", "C64", [1], b"\0" * 8), ("e8", "F8_E8M0", [1], b"\x7f")])
    s["ok_unicode_names.safetensors"] = good([("модель.вес", "F32", [1], b"\0\0\x80\x3f"), ("名前", "U8", [1], b"\x01")], {"note": "ünïcödé ✓", "format": "pt"})
    s["ok_escaped_names.safetensors"] = image('{"a\\"b\\\\c\\u00e9":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x05")
    s["ok_escaped_backslash_u0000.safetensors"] = image('{"a\\\\u0000":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x01")
    s["ok_offsets_out_of_order.safetensors"] = image(hjson({"b": entry("F32", [1], 4, 8), "a": entry("F32", [1], 0, 4)}), struct.pack("<2f", 1, 2))
    s["ok_shape_2p53_zero.safetensors"] = image('{"a":{"dtype":"U8","shape":[9007199254740992,0],"data_offsets":[0,0]}}')
    s["ok_eight_dims.safetensors"] = image(hjson({"a": entry("I16", [1, 2, 1, 2, 1, 1, 1, 1], 0, 8)}), b"\1\0\2\0\3\0\4\0")
    s["ok_all_numeric.safetensors"] = good([
        ("bool", "BOOL", [2], b"\0\1"), ("u8", "U8", [2], b"\1\2"), ("i8", "I8", [2], b"\xff\x02"),
        ("i16", "I16", [1], struct.pack("<h", -3)), ("u16", "U16", [1], struct.pack("<H", 65535)),
        ("f16", "F16", [1], b"\x00\x3c"), ("bf16", "BF16", [1], b"\x80\x3f"),
        ("i32", "I32", [1], struct.pack("<i", -7)), ("u32", "U32", [1], struct.pack("<I", 7)),
        ("f32", "F32", [1], struct.pack("<f", 0.5)), ("f64", "F64", [1], struct.pack("<d", -0.25)),
        ("i64", "I64", [1], struct.pack("<q", -(2**40))), ("u64", "U64", [1], struct.pack("<Q", 2**63))])
    return s


def shard(tensors):
    return good(tensors, {"format": "pt"})


def index_cases():
    """CASE -> {file name: bytes}."""
    A = ("a.weight", "F32", [2], F32x2)
    B = ("b.weight", "F32", [1], struct.pack("<f", 4.0))
    C = ("c.bias", "BF16", [2], b"\x80\x3f\x00\x40")
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"

    def idx(wm, meta=True):
        obj = {"weight_map": wm}
        if meta:
            obj = {"metadata": {"total_size": 16}, "weight_map": wm}
        return json.dumps(obj, indent=2).encode()

    ok_map = {"a.weight": s1, "b.weight": s1, "c.bias": s2}
    base = {s1: shard([A, B]), s2: shard([C])}
    cases = {}
    cases["bad_json"] = dict(base, **{"model.safetensors.index.json": b'{"weight_map": {"a.weight": '})
    cases["not_object"] = dict(base, **{"model.safetensors.index.json": b"[]"})
    cases["no_weight_map"] = dict(base, **{"model.safetensors.index.json": b'{"metadata": {"total_size": 16}}'})
    cases["weight_map_array"] = dict(base, **{"model.safetensors.index.json": b'{"weight_map": ["a.weight"]}'})
    cases["weight_map_empty"] = dict(base, **{"model.safetensors.index.json": b'{"weight_map": {}}'})
    cases["value_not_string"] = dict(base, **{"model.safetensors.index.json": idx({"a.weight": 1, "b.weight": s1, "c.bias": s2})})
    cases["missing_shard"] = {s1: base[s1], "model.safetensors.index.json": idx(ok_map)}
    cases["wrong_shard"] = dict(base, **{"model.safetensors.index.json": idx({"a.weight": s2, "b.weight": s1, "c.bias": s2})})
    cases["listed_twice"] = dict(base, **{"model.safetensors.index.json": (
        '{"weight_map": {"a.weight": "%s", "b.weight": "%s", "c.bias": "%s", "a.weight": "%s"}}' % (s1, s1, s2, s1)).encode()})
    cases["unlisted_tensor"] = dict(base, **{"model.safetensors.index.json": idx({"a.weight": s1, "c.bias": s2})})
    cases["in_two_shards"] = {s1: shard([A, B]), s2: shard([B, C]), "model.safetensors.index.json": idx(ok_map)}
    cases["absent_tensor"] = dict(base, **{"model.safetensors.index.json": idx(dict(ok_map, **{"d.weight": s2}))})
    cases["path_escape"] = dict(base, **{"model.safetensors.index.json": idx({"a.weight": "../" + s1, "b.weight": s1, "c.bias": s2})})
    cases["absolute_path"] = dict(base, **{"model.safetensors.index.json": idx({"a.weight": "/etc/" + s1, "b.weight": s1, "c.bias": s2})})
    cases["truncated_shard"] = {s1: base[s1][:-2], s2: base[s2], "model.safetensors.index.json": idx(ok_map)}
    # a NUL in a tensor or shard name would be cut at it (issue 14 point 11)
    cases["name_with_nul"] = dict(base, **{"model.safetensors.index.json": idx({"a.weight\x00x": s1, "b.weight": s1, "c.bias": s2})})
    cases["shard_name_with_nul"] = dict(base, **{"model.safetensors.index.json": idx({"a.weight": s1 + "\x00.txt", "b.weight": s1, "c.bias": s2})})
    cases["shard_bad_header"] = {s1: base[s1], s2: image(b'{"c.bias":' + b"\xff" + b"}"), "model.safetensors.index.json": idx(ok_map)}
    return cases


def write_tree(root, files):
    if os.path.isdir(root):
        shutil.rmtree(root)
    os.makedirs(root)
    for name, data in files.items():
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)


def main():
    write_tree(BAD, bad_files())
    os.makedirs(IDX, exist_ok=True)
    for case in os.listdir(IDX):
        shutil.rmtree(os.path.join(IDX, case))
    for case, files in index_cases().items():
        write_tree(os.path.join(IDX, case), files)
    os.makedirs(SEEDS, exist_ok=True)
    for name in os.listdir(SEEDS):
        if name.startswith("ok_"):
            os.remove(os.path.join(SEEDS, name))
    for name, data in seeds().items():
        with open(os.path.join(SEEDS, name), "wb") as f:
            f.write(data)
    print(f"{len(os.listdir(BAD))} bad files, {len(os.listdir(IDX))} index cases, "
          f"{len(seeds())} seeds")


if __name__ == "__main__":
    main()
