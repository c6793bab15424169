#!/usr/bin/env python3
"""Dump calibration activations with PyTorch + transformers forward hooks, in
the `bakron-activations` format, version 2 (docs/activations.md: every file
carries the model's config/weights SHA-256 and the calibration tokens'
SHA-256, computed here as src/digest.c does) that
`bakron quantize --activations DIR` reads and checks. For architectures the
native forward pass does not run; for Llama/Qwen, `bakron dump-activations`
writes the same thing. Only the forward pass needs torch + transformers; the
digests and the writer are plain Python (tests/test_dump_activations_py.sh).

    scripts/dump_activations.py MODEL_DIR --calib calib.safetensors --out acts/ [--dtype F32]
"""
import os as _os
import sys as _sys

# scripts/tokenize.py would shadow the standard library's tokenize module
_HERE = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _HERE]

import argparse
import hashlib
import json
import os
import shutil
import struct
import sys

FORMAT = "bakron-activations"
VERSION = 2
ACTS = ("attn_in", "o_in", "mlp_in", "down_in")


# ---------------------------------------------------------------- safetensors
# (plain Python: the digests and the writer need neither numpy nor torch)

def st_header(path):
    """(header dict, offset of the data buffer) of a .safetensors file."""
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        return json.loads(fh.read(n)), 8 + n


def st_write(path, tensors, metadata):
    """Write [(name, dtype, shape, bytes)] as a .safetensors file (in the given
    order, aligned to 8 bytes like bakron's writer) with string metadata."""
    head, off = {}, 0
    if metadata:
        head["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    for name, dtype, shape, data in tensors:
        head[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(head, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(h)))
        fh.write(h)
        for _, _, _, data in tensors:
            fh.write(data)


def load_tokens(path, samples=0, seqlen=0):
    """input_ids [S, T] (I32 or I64) of a token file, cut to samples x seqlen,
    as a list of lists (what `bakron` reads with --samples/--seqlen)."""
    head, base = st_header(path)
    t = head.get("input_ids")
    if not t or t["dtype"] not in ("I32", "I64") or len(t["shape"]) != 2:
        sys.exit(f"{path}: no I32/I64 tensor 'input_ids' [sequences, seqlen]")
    fs, ft = t["shape"]
    S, T = samples or fs, seqlen or ft
    if S > fs or T > ft or S < 1 or T < 2:
        sys.exit(f"{path}: asked for {S} sequences of {T} tokens, file has [{fs}, {ft}]")
    w = 4 if t["dtype"] == "I32" else 8
    with open(path, "rb") as fh:
        fh.seek(base + t["data_offsets"][0])
        raw = fh.read(fs * ft * w)
    code = "<%d%s" % (ft, "i" if w == 4 else "q")
    return [list(struct.unpack_from(code, raw, i * ft * w))[:T] for i in range(S)]


# ------------------------------------------------------ identity (version 2)
# The digests bakron computes (src/digest.c; docs/activations.md "Identity").

def _u64(v):
    return struct.pack("<Q", v)


def model_tensor_files(model_dir):
    """The checkpoint files bakron reads for a model folder (src/safetensors.c
    set_dir): the index's shards, model.safetensors, or the folder's only
    index / .safetensors file."""
    def shards(index):
        wm = json.load(open(index))["weight_map"]
        d = os.path.dirname(index)
        return [os.path.join(d, f) for f in sorted(set(wm.values()))]
    p = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(p):
        return shards(p)
    p = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(p):
        return [p]
    names = [n for n in os.listdir(model_dir) if not n.startswith(".")]
    idx = [n for n in names if n.endswith(".safetensors.index.json")]
    one = [n for n in names if n.endswith(".safetensors")]
    if len(idx) == 1:
        return shards(os.path.join(model_dir, idx[0]))
    if len(one) == 1 and not idx:
        return [os.path.join(model_dir, one[0])]
    sys.exit(f"{model_dir}: no single checkpoint (index or .safetensors file) to digest")


def model_digests(model_dir):
    """(config_sha256, weights_sha256) of a model folder."""
    cfg = hashlib.sha256(open(os.path.join(model_dir, "config.json"), "rb").read()).hexdigest()
    tensors = []
    for path in model_tensor_files(model_dir):
        head, base = st_header(path)
        for name, t in head.items():
            if name != "__metadata__":
                tensors.append((name.encode(), t, path, base))
    tensors.sort(key=lambda x: x[0])  # by name, bytewise (bakron's strcmp order)
    s = hashlib.sha256(b"bakron weights digest 1\0")
    s.update(_u64(len(tensors)))
    BLOCK, BLOCKS = 4096, 16
    for name, t, path, base in tensors:
        s.update(name + b"\0")
        s.update(t["dtype"].encode() + b"\0")
        s.update(_u64(len(t["shape"])))
        for d in t["shape"]:
            s.update(_u64(d))
        b0, b1 = t["data_offsets"]
        nbytes = b1 - b0
        s.update(_u64(nbytes))
        with open(path, "rb") as fh:
            if nbytes <= BLOCK * BLOCKS:
                fh.seek(base + b0)
                s.update(fh.read(nbytes))
            else:  # 16 blocks of 4 KiB spread evenly from the first byte to the last
                span = nbytes - BLOCK
                for k in range(BLOCKS):
                    fh.seek(base + b0 + span * k // (BLOCKS - 1))
                    s.update(fh.read(BLOCK))
    return cfg, s.hexdigest()


def calibration_digest(ids):
    """calibration_sha256 of the token rows actually used."""
    s = hashlib.sha256(b"bakron calibration digest 1\0")
    s.update(_u64(len(ids)))
    s.update(_u64(len(ids[0])))
    for row in ids:
        s.update(struct.pack("<%dI" % len(row), *[v & 0xFFFFFFFF for v in row]))
    return s.hexdigest()


# ---------------------------------------------------------------- the dump

def write_dump(out, model_dir, calib, ids, model_info, dtype, layer_tensors, producer):
    """Write a version 2 dump: layer_tensors(l) gives {name: (shape, bytes)}
    for the four activations of layer l (dtype `dtype`). The folder is built
    under OUT.tmp-PID and renamed into place."""
    cfg_sha, w_sha = model_digests(model_dir)
    cal_sha = calibration_digest(ids)
    S, T = len(ids), len(ids[0])
    L = model_info["n_layers"]
    tmp = out.rstrip("/") + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    pos = struct.pack("<%di" % (S * T), *[i % T for i in range(S * T)])
    files = []
    for l in range(L):
        acts = layer_tensors(l)
        tensors = [(k, dtype, acts[k][0], acts[k][1]) for k in ACTS]
        tensors.append(("position_ids", "I32", (S * T,), pos))
        fn = f"layer.{l:04d}.safetensors"
        st_write(os.path.join(tmp, fn), tensors,
                 {"layer": l, "config_sha256": cfg_sha, "weights_sha256": w_sha,
                  "calibration_sha256": cal_sha})
        files.append(fn)
    man = {
        "format": FORMAT, "version": VERSION, "producer": producer,
        "model": dict(model_info, config_sha256=cfg_sha, weights_sha256=w_sha),
        "sequences": S, "seqlen": T, "dtype": dtype, "compression": "none", "layers": L,
        "files": files, "calibration": calib, "calibration_sha256": cal_sha,
    }
    with open(os.path.join(tmp, "manifest.json"), "w") as fh:
        json.dump(man, fh, indent=2)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.replace(tmp, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--calib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=0)
    ap.add_argument("--seqlen", type=int, default=0)
    ap.add_argument("--dtype", default="F32", choices=["F32", "BF16", "F16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    ids = load_tokens(a.calib, a.samples, a.seqlen)
    S, T = len(ids), len(ids[0])
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32).to(a.device).eval()
    cfg = model.config
    layers = model.model.layers
    L = len(layers)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tdt = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[a.dtype]

    taps = {}

    def hook(name, l):
        def f(mod, args):
            taps.setdefault((l, name), []).append(args[0].detach().reshape(-1, args[0].shape[-1]).to("cpu", torch.float32))
        return f

    handles = []
    for l, layer in enumerate(layers):
        handles.append(layer.self_attn.q_proj.register_forward_pre_hook(hook("attn_in", l)))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(hook("o_in", l)))
        handles.append(layer.mlp.gate_proj.register_forward_pre_hook(hook("mlp_in", l)))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(hook("down_in", l)))
    with torch.no_grad():
        for s0 in range(0, S, a.batch):
            x = torch.tensor(ids[s0:s0 + a.batch], dtype=torch.int64, device=a.device)
            model(input_ids=x, use_cache=False)
    for h in handles:
        h.remove()

    def layer_tensors(l):
        out = {}
        for k in ACTS:
            t = torch.cat(taps.pop((l, k))).to(tdt).contiguous()
            raw = t.view(torch.int16) if tdt != torch.float32 else t  # numpy has no bfloat16
            out[k] = (tuple(t.shape), raw.numpy().tobytes())
        return out

    info = {"model_type": cfg.model_type, "n_layers": L, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
            "head_dim": head_dim, "vocab_size": cfg.vocab_size}
    write_dump(a.out, a.model, a.calib, ids, info, a.dtype, layer_tensors,
               "scripts/dump_activations.py (transformers)")
    print(f"{a.out}: {L} layers, {S} x {T} tokens, {a.dtype}", file=sys.stderr)


if __name__ == "__main__":
    main()
