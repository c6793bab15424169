#!/usr/bin/env python3
"""Generate the seed corpora of the libFuzzer targets (tests/fuzz/, docs/FUZZING.md)
and the micro model they use (tests/fuzz/micro-model: Llama, 1 layer, hidden 8).

Standard library only; safetensors images are written by hand. The activation
dump seeds are made by bakron itself (`dump-activations` of the micro model):
pass the binary. Deterministic; rerun after editing and commit the result:

    python3 scripts/make_fuzz_corpus.py build-cpu/bakron
"""
import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
FUZZ = os.path.join(ROOT, "tests", "fuzz")
sys.path.insert(0, HERE)
import make_bad_models as mbm  # noqa: E402  (micro_tensors, st_bytes, MICRO)


def image(tensors, meta=None):
    """safetensors image from name -> (dtype, shape, bytes)."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        dt, shape, data = tensors[name]
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    if meta:
        header["__metadata__"] = meta
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def reset(d):
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)


def write(d, name, data):
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def main():
    bakron = sys.argv[1] if len(sys.argv) > 1 else None
    # the micro model
    mm = os.path.join(FUZZ, "micro-model")
    reset(mm)
    cfg = dict(mbm.MICRO)
    write(mm, "config.json", json.dumps(cfg, indent=2) + "\n")
    write(mm, "model.safetensors", mbm.st_bytes(mbm.micro_tensors(cfg)))

    # config.json: the bundled models' configs and a few variants
    d = os.path.join(FUZZ, "corpus-config")
    reset(d)
    for p in sorted(glob.glob(os.path.join(ROOT, "tests", "data", "models", "*", "config.json")) +
                    glob.glob(os.path.join(ROOT, "examples", "*", "config.json"))):
        write(d, "seed_" + os.path.basename(os.path.dirname(p)) + ".json", open(p).read())
    write(d, "seed_micro.json", json.dumps(cfg))
    v = dict(cfg, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    write(d, "seed_llama3_rope.json", json.dumps(v))
    v = dict(cfg, model_type="qwen2", use_sliding_window=True, sliding_window=16,
             max_window_layers=1, eos_token_id=[1, 2], bos_token_id=None)
    write(d, "seed_qwen2_window.json", json.dumps(v))
    v = dict(cfg, rope_theta=None, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                    "rope_theta": 500000.0})
    write(d, "seed_rope_parameters.json", json.dumps(v))

    # model.safetensors.index.json (the target provides two fixed shards)
    d = os.path.join(FUZZ, "corpus-index")
    reset(d)
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    wm = {"a.weight": s1, "b.weight": s1, "c.bias": s2}
    write(d, "seed_ok.json", json.dumps({"metadata": {"total_size": 16}, "weight_map": wm}, indent=2))
    write(d, "seed_no_meta.json", json.dumps({"weight_map": wm}))
    write(d, "seed_wrong_shard.json", json.dumps({"weight_map": dict(wm, **{"a.weight": s2})}))
    write(d, "seed_escape.json", json.dumps({"weight_map": dict(wm, **{"a.weight": "../" + s1})}))

    # token files
    d = os.path.join(FUZZ, "corpus-tokens")
    reset(d)
    ids = [(k * 7) % 16 for k in range(2 * 8)]
    write(d, "seed_i32.safetensors", image({"input_ids": ("I32", [2, 8], struct.pack("<16i", *ids))}))
    write(d, "seed_i64.safetensors", image({"input_ids": ("I64", [4, 4], struct.pack("<16q", *ids))},
                                           {"format": "pt"}))
    write(d, "seed_extra.safetensors", image({"input_ids": ("I32", [1, 4], struct.pack("<4i", 1, 2, 3, 4)),
                                              "attention_mask": ("I32", [1, 4], struct.pack("<4i", 1, 1, 1, 0))}))
    write(d, "seed_out_of_vocab.safetensors", image({"input_ids": ("I32", [1, 3], struct.pack("<3i", 1, 99999, 2))}))

    # presets: the shipped ones
    d = os.path.join(FUZZ, "corpus-preset")
    reset(d)
    for p in sorted(glob.glob(os.path.join(ROOT, "configs", "*.json"))):
        write(d, "seed_" + os.path.basename(p), open(p).read())

    # activation manifest + layer file: MANIFEST \0 LAYER-FILE (see fuzz_actdump.c)
    d = os.path.join(FUZZ, "corpus-actdump")
    reset(d)
    if bakron:
        tmp = tempfile.mkdtemp()
        try:
            calib = os.path.join(tmp, "calib.safetensors")
            with open(calib, "wb") as f:
                f.write(image({"input_ids": ("I32", [2, 8], struct.pack("<16i", *ids))}))
            for name, extra in (("plain", []), ("zstd", ["--zstd"]), ("bf16", ["--dtype", "BF16"])):
                out = os.path.join(tmp, name)
                subprocess.run([bakron, "dump-activations", mm, "--calib", calib, "--out", out,
                                "--backend", "cpu"] + extra, check=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                man = json.load(open(os.path.join(out, "manifest.json")))
                man["calibration"] = "calib.safetensors"  # no temporary path in the seed
                man.pop("device", None)
                layer = open(os.path.join(out, man["files"][0]), "rb").read()
                write(d, "seed_%s" % name, json.dumps(man).encode() + b"\0" + layer)
            # version 1 (no digests)
            man = json.load(open(os.path.join(tmp, "plain", "manifest.json")))
            man["version"] = 1
            man["calibration"] = "calib.safetensors"
            for k in ("config_sha256", "weights_sha256"):
                man["model"].pop(k)
            man.pop("calibration_sha256")
            man.pop("device", None)
            layer = open(os.path.join(tmp, "plain", man["files"][0]), "rb").read()
            write(d, "seed_v1", json.dumps(man).encode() + b"\0" + layer)
        finally:
            shutil.rmtree(tmp)
    for t in ("config", "index", "tokens", "preset", "actdump"):
        print("%s: %d seeds" % (t, len(os.listdir(os.path.join(FUZZ, "corpus-" + t)))))


if __name__ == "__main__":
    main()
