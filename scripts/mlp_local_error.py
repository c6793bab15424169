#!/usr/bin/env python3
"""Diagnose the MLP-local objective of quantized models: for every STEP-th layer,
the relative squared MLP output error sum ||MLP_q(x) - MLP(x)||^2 / sum ||MLP(x)||^2 on
full-precision calibration inputs (an activation dump of the FP model, docs/activations.md),
for all tokens, the first position of each window, and the other positions. With
--shampoo-weights, also how the Shampoo input factor weights the first position.

    bakron dump-activations MODEL --calib calib.safetensors --samples 8 --out acts/
    scripts/mlp_local_error.py MODEL acts/ q-gptq/ q-mlplocal-kfac/ q-mlplocal-shampoo/ [--tokens 2048]

Quantized folders are bakron native exports with per-row (levels) scales.
"""
import os as _os
import sys as _sys

_HERE = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _HERE]

import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("acts")
    ap.add_argument("quantized", nargs="+")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--step", type=int, default=3)
    ap.add_argument("--shampoo-weights", action="store_true")
    a = ap.parse_args()
    import numpy as np
    from safetensors.numpy import load_file

    def load_model(d):
        idx = os.path.join(d, "model.safetensors.index.json")
        if os.path.exists(idx):
            out = {}
            for f in sorted(set(json.load(open(idx))["weight_map"].values())):
                out.update(load_file(os.path.join(d, f)))
            return out
        return load_file(os.path.join(d, "model.safetensors"))

    def deq(st, pre):
        if pre + ".weight" in st:
            return st[pre + ".weight"].astype(np.float64)
        q = st[pre + ".qweight"].astype(np.float64)
        s = st[pre + ".scales"].astype(np.float64)
        if s.shape[1] != 1:
            raise SystemExit(f"{pre}: only per-row scales are supported here")
        if pre + ".qzeros" in st:
            q = q - st[pre + ".qzeros"].astype(np.float64)
        return q * s

    def silu(x):
        return x / (1 + np.exp(-x))

    man = json.load(open(os.path.join(a.acts, "manifest.json")))
    T = man["seqlen"]
    orig = load_model(a.model)
    qs = [load_model(d) for d in a.quantized]
    names = [os.path.basename(d.rstrip("/")) for d in a.quantized]
    print("layer  " + "  ".join(f"{n:>28s}" for n in names))
    print("       " + "  ".join(f"{'all':>9s} {'pos0':>9s} {'pos>0':>8s}" for _ in names))
    tot = np.zeros((len(qs), 3))
    for l in range(0, man["layers"], a.step):
        acts = load_file(os.path.join(a.acts, man["files"][l]))
        x = acts["mlp_in"].astype(np.float64)[: a.tokens]
        pos0 = (np.arange(x.shape[0]) % T) == 0
        P = f"model.layers.{l}.mlp."
        Wg, Wu, Wd = (orig[P + n + ".weight"].astype(np.float64) for n in ("gate_proj", "up_proj", "down_proj"))
        g = silu(x @ Wg.T)
        ref = (g * (x @ Wu.T)) @ Wd.T
        r2 = np.sum(ref ** 2, axis=1)
        row = []
        for i, st in enumerate(qs):
            gq, uq, dq = (deq(st, P + n) for n in ("gate_proj", "up_proj", "down_proj"))
            out = (silu(x @ gq.T) * (x @ uq.T)) @ dq.T
            e2 = np.sum((out - ref) ** 2, axis=1)
            v = [e2.sum() / r2.sum(), e2[pos0].sum() / r2[pos0].sum(), e2[~pos0].sum() / r2[~pos0].sum()]
            tot[i] += v
            row.append(f"{v[0]:9.4f} {v[1]:9.4f} {v[2]:8.4f}")
        extra = ""
        if a.shampoo_weights:
            w = (g ** 2) @ np.sum(Wd ** 2, axis=0)
            xn = np.sum(x ** 2, axis=1)
            extra = (f"   shampoo weight pos0/median {w[pos0].mean() / np.median(w):.2f}, "
                     f"share of tr(A) at pos0: kfac {xn[pos0].sum() / xn.sum():.4f} "
                     f"shampoo {(w * xn)[pos0].sum() / (w * xn).sum():.4f}")
        print(f"{l:5d}  " + "  ".join(row) + extra)
    print("sum    " + "  ".join(f"{t[0]:9.4f} {t[1]:9.4f} {t[2]:8.4f}" for t in tot))


if __name__ == "__main__":
    main()
