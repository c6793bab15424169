#!/usr/bin/env python3
"""Share of the first position (the attention sink) in the trace of each linear
module's input Gram, per layer (issue 16, docs/hessians.md "Why the local variants
lose their edge", hypothesis 3: the relative damping delta * mean(diag A) is set
by tr(A), which position 0 can dominate).

From an activation dump of the full-precision model (`bakron dump-activations
--dtype f32`, docs/activations.md) it prints, per layer, for the inputs of
q/k/v_proj (attn_in), o_proj (o_in), gate/up_proj (mlp_in) and down_proj
(down_in):

  share0  sum over position-0 tokens of |x_t|^2 / sum over all tokens of |x_t|^2
          = the share of position 0 in tr(E[x x^T]) (K-FAC's and GPTQ's A);
  c       mean |x_t|^2 at position 0 / mean |x_t|^2 at the other positions, so that
          share0 = c / (c + T - 1): the same c predicts the share at another T.

With --model MODEL (the checkpoint the dump was made from) also the MLP-local
output factors of gate_proj and up_proj (mlplocal-kfac's B, docs/hessians.md
"MLP-local"): tr(B_up) = (1/N) sum_t sum_i g_ti^2 (D^T D)_ii with g = silu(W_gate x),
tr(B_gate) the same with f = silu'(W_gate x) * (W_up x); their position-0 shares.

Where the dump's calibration token file is at hand (the manifest's path, or
--tokens), also the share of the other tokens with position 0's id (SmolLM2's
windows start with <|endoftext|>, which also separates documents inside a window):
their share of the trace against their share of the tokens.

    bakron dump-activations MODEL --calib TOKENS --samples 16 --dtype f32 --out ACTS
    scripts/sink_share.py ACTS --model MODEL [--json OUT.json]

Reads plain layer files (not --zstd dumps); F32, BF16 or F16 dumps.
"""
import os as _os
import sys as _sys

_HERE = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _HERE]

import argparse
import json
import os
import struct
import sys

import numpy as np

INPUTS = [("attn_in", "q/k/v in"), ("o_in", "o in"), ("mlp_in", "gate/up in"), ("down_in", "down in")]


def st_tensors(path):
    """name -> numpy array (memory-mapped) of a safetensors file; BF16 widened to F32."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
    base = 8 + n
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    dt = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I32": "<i4", "I64": "<i8", "BF16": "<u2"}
    out = {}
    for name, t in hdr.items():
        if name == "__metadata__":
            continue
        if t["dtype"] not in dt:
            sys.exit(f"sink_share: {path}: {name}: dtype {t['dtype']} not supported")
        lo, hi = t["data_offsets"]
        a = mm[base + lo:base + hi].view(dt[t["dtype"]]).reshape(t["shape"])
        if t["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = a
    return out


def model_tensors(d):
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        out = {}
        for f in sorted(set(json.load(open(idx))["weight_map"].values())):
            out.update(st_tensors(os.path.join(d, f)))
        return out
    return st_tensors(os.path.join(d, "model.safetensors"))


def share(e, sel):
    tot = e.sum()
    return float(e[sel].sum() / tot) if tot > 0 else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("acts", help="activation dump folder (bakron dump-activations)")
    ap.add_argument("--model", help="the model folder: also the MLP-local B of gate/up_proj")
    ap.add_argument("--tokens", help="the dump's calibration token file (default: the manifest's, if present)")
    ap.add_argument("--json", help="write the numbers to this file")
    a = ap.parse_args()

    man = json.load(open(os.path.join(a.acts, "manifest.json")))
    if man.get("compression", "none") != "none":
        sys.exit("sink_share: a --zstd dump: dump again without --zstd")
    S, T = int(man["sequences"]), int(man["seqlen"])
    ids = None
    tokf = a.tokens or man.get("calibration")
    if tokf and os.path.exists(tokf):
        t = st_tensors(tokf)["input_ids"]
        if t.shape[0] >= S and t.shape[1] >= T:
            ids = np.asarray(t[:S, :T]).reshape(-1)
    W = model_tensors(a.model) if a.model else None
    res = {"acts": a.acts, "sequences": S, "seqlen": T, "calibration": man.get("calibration"),
           "dtype": man.get("dtype"), "layers": []}
    cols = [lbl for _, lbl in INPUTS] + (["B gate (mlplocal)", "B up (mlplocal)"] if W else [])
    print(f"{a.acts}: {S} sequences x {T} tokens ({man.get('dtype')}), calibration {man.get('calibration')}")
    print(f"share of position 0 in the trace (c = mean at position 0 / mean elsewhere; "
          f"share = c / (c + T - 1), uniform = {100 / T:.2f}%)\n")
    print("| layer | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    sep_rows = []
    for l in range(man["layers"]):
        L = st_tensors(os.path.join(a.acts, man["files"][l]))
        pos = np.asarray(L["position_ids"]).reshape(-1)
        p0 = pos == 0
        sep = None
        if ids is not None:
            first = np.repeat(ids.reshape(S, T)[:, 0], T)
            sep = (ids == first) & ~p0
        ent, cells, sepc = {"layer": l}, [], []
        energies = {}
        for name, _ in INPUTS:
            x = np.asarray(L[name], dtype=np.float64)
            energies[name] = np.einsum("ij,ij->i", x, x)
        if W is not None:
            P = f"model.layers.{l}.mlp."
            x = np.asarray(L["mlp_in"], dtype=np.float64)
            Wg = np.asarray(W[P + "gate_proj.weight"], dtype=np.float64)
            Wu = np.asarray(W[P + "up_proj.weight"], dtype=np.float64)
            Wd = np.asarray(W[P + "down_proj.weight"], dtype=np.float64)
            dd = np.sum(Wd * Wd, axis=0)  # diag(D^T D)
            zg, zu = x @ Wg.T, x @ Wu.T
            sg = 1.0 / (1.0 + np.exp(-zg))
            g = zg * sg
            f = sg * (1.0 + zg * (1.0 - sg)) * zu
            energies["B_gate"] = (f * f) @ dd
            energies["B_up"] = (g * g) @ dd
        for name, e in energies.items():
            s0 = share(e, p0)
            rest = e[~p0].mean() if (~p0).any() else float("nan")
            c = float(e[p0].mean() / rest) if rest > 0 else float("nan")
            ent[name] = {"share0": s0, "c": c}
            cells.append(f"{100 * s0:.2f}% (c {c:.3g})")
            if sep is not None and sep.any():
                ent[name]["share_sep"] = share(e, sep)
                sepc.append(f"{100 * ent[name]['share_sep']:.2f}%")
        if sep is not None:
            ent["sep_tokens"] = int(sep.sum())
        res["layers"].append(ent)
        print(f"| {l} | " + " | ".join(cells) + " |", flush=True)
        if sepc:
            sep_rows.append(f"| {l} | " + " | ".join(sepc) + " |")
    if sep_rows:
        n = res["layers"][0]["sep_tokens"]
        print(f"\nthe {n} other tokens with position 0's id ({100 * n / (S * T):.2f}% of the tokens): "
              f"their share of the trace\n")
        print("| layer | " + " | ".join(cols) + " |")
        print("|---" * (len(cols) + 1) + "|")
        print("\n".join(sep_rows))
    elif ids is not None:
        print("\n(no other token has position 0's id)")
    else:
        print("\n(calibration tokens not found: no separator shares; give --tokens)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
