#!/usr/bin/env python3
"""Dump calibration activations with PyTorch + transformers forward hooks, in
the `bakron-activations` format (docs/activations.md) that
`bakron quantize --activations DIR` reads. For architectures the native
forward pass does not run; for Llama/Qwen, `bakron dump-activations` writes the
same thing.

    scripts/dump_activations.py MODEL_DIR --calib calib.safetensors --out acts/ [--dtype F32]
"""
import os as _os
import sys as _sys

# scripts/tokenize.py would shadow the standard library's tokenize module
_HERE = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _HERE]

import argparse
import json
import os
import shutil
import sys


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

    import numpy as np
    import torch
    from safetensors.numpy import load_file
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    ids = load_file(a.calib)["input_ids"].astype(np.int64)
    if a.samples:
        ids = ids[: a.samples]
    if a.seqlen:
        ids = ids[:, : a.seqlen]
    S, T = ids.shape
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
            x = torch.from_numpy(ids[s0:s0 + a.batch]).to(a.device)
            model(input_ids=x, use_cache=False)
    for h in handles:
        h.remove()

    tmp = a.out.rstrip("/") + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    files = []
    pos = torch.arange(T, dtype=torch.int32).repeat(S)
    for l in range(L):
        t = {k: torch.cat(taps[(l, k)]).to(tdt).contiguous() for k in ("attn_in", "o_in", "mlp_in", "down_in")}
        t["position_ids"] = pos
        fn = f"layer.{l:04d}.safetensors"
        save_file(t, os.path.join(tmp, fn), metadata={"format": "pt", "layer": str(l)})
        files.append(fn)
    man = {
        "format": "bakron-activations", "version": 1,
        "producer": "scripts/dump_activations.py (transformers)",
        "model": {"model_type": cfg.model_type, "n_layers": L, "hidden_size": cfg.hidden_size,
                  "intermediate_size": cfg.intermediate_size,
                  "num_attention_heads": cfg.num_attention_heads,
                  "num_key_value_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
                  "head_dim": head_dim, "vocab_size": cfg.vocab_size},
        "sequences": S, "seqlen": T, "dtype": a.dtype, "compression": "none", "layers": L,
        "files": files, "calibration": a.calib,
    }
    with open(os.path.join(tmp, "manifest.json"), "w") as fh:
        json.dump(man, fh, indent=2)
    if os.path.exists(a.out):
        shutil.rmtree(a.out)
    os.replace(tmp, a.out)
    print(f"{a.out}: {L} layers, {S} x {T} tokens, {a.dtype}", file=sys.stderr)


if __name__ == "__main__":
    main()
