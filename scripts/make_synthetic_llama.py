#!/usr/bin/env python3
"""Write a Llama-3-shaped checkpoint with random weights, for benchmarks on
hosts without network access (issue 6; docs/BENCHMARKS.md "Pipeline on the
GPU"), plus random calibration tokens.

    scripts/make_synthetic_llama.py OUT --shape 8b|1b|70b|405b [--seed S]
        [--calib-seqs 256] [--calib-len 2048] [--max-shard-bytes 5e9]
        [--layers L] [--vocab V]

--shape 8b: Llama-3-8B (32 layers, hidden 4096, intermediate 14336, 32 / 8
heads, head_dim 128, vocab 128256, untied, rope llama3 factor 8); --shape 1b:
Llama-3.2-1B (16 layers, hidden 2048, intermediate 8192, 32 / 8 heads,
head_dim 64, tied embeddings, rope llama3 factor 32); --shape 70b:
Llama-3-70B (80 layers, hidden 8192, intermediate 28672, 64 / 8 heads,
vocab 128256, untied); --shape 405b: Llama-3.1-405B (126 layers, hidden
16384, intermediate 53248, 128 / 8 heads). --shape tiny is a 2-layer toy
for checking the script itself. --layers L keeps the widths with L layers
(a 70B-width model whose checkpoint fits a disk: 1.71 GB per 70B layer,
6.5 GB per 405B layer, plus 2 x vocab x hidden x 2 bytes of embeddings and
head); --vocab V replaces the vocabulary (width checks on a small machine).

Weights are BF16, sharded safetensors with model.safetensors.index.json and
config.json. Every matrix is N(0, 1/fan_in) (its outputs have the scale of
its normalized inputs), the embeddings N(0, 1), norms 1: activations stay
finite through every layer. Random weights mean nothing for quality; only
the shapes and the time matter. Tensors are generated one at a time in
chunks of rows (bounded memory: about 200 MB whatever the shape), from a
seeded generator (the same seed gives the same files).

--generator torch draws the values with PyTorch on the GPU when one is
present (an 8B checkpoint in well under a minute instead of several with
NumPy on one core); the values then differ from --generator numpy (the
default), but are again fixed by the seed.

OUT/calib.safetensors holds input_ids I32 [calib-seqs, calib-len], uniform
over the vocabulary.
"""
import os as _os
import sys as _sys

# scripts/tokenize.py would shadow the standard library's tokenize (docs/smollm2.md)
_HERE = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _HERE]

import argparse
import json
import os
import struct
import sys

import numpy as np

SHAPES = {
    "8b": dict(layers=32, hidden=4096, inter=14336, heads=32, kv=8, head_dim=128, vocab=128256,
               tie=False, rope_factor=8.0, max_pos=131072),
    "1b": dict(layers=16, hidden=2048, inter=8192, heads=32, kv=8, head_dim=64, vocab=128256,
               tie=True, rope_factor=32.0, max_pos=131072),
    "70b": dict(layers=80, hidden=8192, inter=28672, heads=64, kv=8, head_dim=128, vocab=128256,
                tie=False, rope_factor=8.0, max_pos=131072),
    "405b": dict(layers=126, hidden=16384, inter=53248, heads=128, kv=8, head_dim=128,
                 vocab=128256, tie=False, rope_factor=8.0, max_pos=131072),
    "tiny": dict(layers=2, hidden=256, inter=512, heads=4, kv=2, head_dim=64, vocab=1000,
                 tie=False, rope_factor=8.0, max_pos=4096),
}

CHUNK = 1 << 24  # elements generated at a time (64 MB of float32)


def config_json(s):
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s["hidden"],
        "intermediate_size": s["inter"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv"],
        "head_dim": s["head_dim"],
        "vocab_size": s["vocab"],
        "max_position_embeddings": s["max_pos"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": s["rope_factor"],
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": s["tie"],
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000 if s["vocab"] > 128001 else 1,
        "eos_token_id": 128001 if s["vocab"] > 128001 else 2,
        "bakron_synthetic": "random weights (scripts/make_synthetic_llama.py); shapes only",
    }


def tensors(s):
    """(name, shape, kind) in file order; kind: 'mat' (N(0, 1/fan_in)),
    'emb' (N(0, 1)) or 'ones'."""
    h, i, hd = s["hidden"], s["inter"], s["head_dim"]
    qd, kd = s["heads"] * hd, s["kv"] * hd
    out = [("model.embed_tokens.weight", (s["vocab"], h), "emb")]
    for l in range(s["layers"]):
        p = f"model.layers.{l}."
        out += [
            (p + "input_layernorm.weight", (h,), "ones"),
            (p + "self_attn.q_proj.weight", (qd, h), "mat"),
            (p + "self_attn.k_proj.weight", (kd, h), "mat"),
            (p + "self_attn.v_proj.weight", (kd, h), "mat"),
            (p + "self_attn.o_proj.weight", (h, qd), "mat"),
            (p + "post_attention_layernorm.weight", (h,), "ones"),
            (p + "mlp.gate_proj.weight", (i, h), "mat"),
            (p + "mlp.up_proj.weight", (i, h), "mat"),
            (p + "mlp.down_proj.weight", (h, i), "mat"),
        ]
    out.append(("model.norm.weight", (h,), "ones"))
    if not s["tie"]:
        out.append(("lm_head.weight", (s["vocab"], h), "mat"))
    return out


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def to_bf16(x):
    """float32 array -> uint16 BF16 bits, round to nearest even (finite input)."""
    u = x.view(np.uint32)
    u = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (u >> np.uint32(16)).astype(np.uint16)


def header_bytes(entries, extra=None):
    hdr = {}
    if extra:
        hdr["__metadata__"] = extra
    off = 0
    for name, shape, nbytes, dtype in entries:
        hdr[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_tensor_torch(f, shape, kind, seed, dev):
    import torch
    n = numel(shape)
    if kind == "ones":
        f.write(torch.ones(n, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
        return
    cols = shape[-1]
    std = 1.0 if kind == "emb" else 1.0 / float(np.sqrt(cols))
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    rows = n // cols
    rows_per = max(1, (CHUNK * 8) // cols)
    for r0 in range(0, rows, rows_per):
        nr = min(rows_per, rows - r0)
        x = torch.randn((nr, cols), generator=g, device=dev, dtype=torch.float32)
        x.mul_(std)
        f.write(x.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())


def write_tensor(f, shape, kind, rng):
    n = numel(shape)
    if kind == "ones":
        f.write(to_bf16(np.ones(n, dtype=np.float32)).tobytes())
        return
    cols = shape[-1]
    std = 1.0 if kind == "emb" else 1.0 / np.sqrt(cols)
    rows_per = max(1, CHUNK // cols)
    rows = n // cols
    for r0 in range(0, rows, rows_per):
        nr = min(rows_per, rows - r0)
        x = rng.standard_normal((nr, cols), dtype=np.float32)
        x *= np.float32(std)
        f.write(to_bf16(x).tobytes())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calib-seqs", type=int, default=256)
    ap.add_argument("--calib-len", type=int, default=2048)
    ap.add_argument("--max-shard-bytes", type=float, default=5e9)
    ap.add_argument("--generator", choices=["numpy", "torch"], default="numpy")
    ap.add_argument("--layers", type=int, default=0, help="number of layers (default: the shape's)")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the shape's)")
    a = ap.parse_args()
    dev = None
    if a.generator == "torch":
        import torch
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if a.calib_seqs < 1 or a.calib_len < 2:
        sys.exit("make_synthetic_llama: --calib-seqs >= 1 and --calib-len >= 2 are required")
    s = dict(SHAPES[a.shape])
    if a.layers > 0:
        s["layers"] = a.layers
    if a.vocab > 0:
        s["vocab"] = a.vocab
    os.makedirs(a.out, exist_ok=True)
    ts = tensors(s)
    # shard plan: consecutive tensors up to max-shard-bytes each
    shards, cur, size = [], [], 0
    for name, shape, kind in ts:
        nb = numel(shape) * 2
        if cur and size + nb > a.max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape, kind))
        size += nb
    shards.append(cur)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = (f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                 else "model.safetensors")
        entries = [(n, sh, numel(sh) * 2, "BF16") for n, sh, _ in shard]
        tmp = os.path.join(a.out, fname + ".tmp")
        with open(tmp, "wb") as f:
            f.write(header_bytes(entries, {"format": "pt"}))
            for idx, (name, shape, kind) in enumerate(shard):
                # one generator per tensor: the values do not depend on the sharding
                seed = [a.seed, ts.index((name, shape, kind))]
                if dev:
                    write_tensor_torch(f, shape, kind, a.seed * 1000003 + seed[1], dev)
                else:
                    write_tensor(f, shape, kind, np.random.default_rng(seed))
                weight_map[name] = fname
                total += numel(shape) * 2
        os.replace(tmp, os.path.join(a.out, fname))
        print(f"{fname}: {len(shard)} tensors", file=sys.stderr)
    if len(shards) > 1:
        with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config_json(s), f, indent=2)
    rng = np.random.default_rng([a.seed, 1 << 20])
    ids = rng.integers(0, s["vocab"], size=(a.calib_seqs, a.calib_len), dtype=np.int32)
    cal = os.path.join(a.out, "calib.safetensors")
    with open(cal + ".tmp", "wb") as f:
        f.write(header_bytes([("input_ids", ids.shape, ids.nbytes, "I32")]))
        f.write(ids.astype("<i4").tobytes())
    os.replace(cal + ".tmp", cal)
    params = sum(numel(sh) for _, sh, _ in ts)
    print(f"{a.out}: {a.shape}, {params / 1e9:.2f} B parameters ({total / 1e9:.2f} GB BF16) in "
          f"{len(shards)} file(s); calib.safetensors {a.calib_seqs} x {a.calib_len}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
