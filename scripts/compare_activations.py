#!/usr/bin/env python3
"""Compare two activation dumps (docs/activations.md), e.g. one from
`bakron dump-activations` and one from scripts/dump_activations.py. Prints
the worst relative error max|a-b| / max|b| per tensor; exits 1 if any exceeds
--tol."""
import os as _os
import sys as _sys

# scripts/tokenize.py would shadow the standard library's tokenize module
_HERE = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _HERE]

import argparse
import json
import os
import sys


def load(d, fn):
    from safetensors.numpy import load_file
    p = os.path.join(d, fn)
    if p.endswith(".zst"):
        import zstandard
        import tempfile
        with open(p, "rb") as fh:
            raw = zstandard.ZstdDecompressor().stream_reader(fh).read()
        with tempfile.NamedTemporaryFile(suffix=".safetensors") as t:
            t.write(raw)
            t.flush()
            return load_file(t.name)
    return load_file(p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    import numpy as np
    ma = json.load(open(os.path.join(a.a, "manifest.json")))
    mb = json.load(open(os.path.join(a.b, "manifest.json")))
    for k in ("sequences", "seqlen", "layers"):
        if ma[k] != mb[k]:
            print(f"manifest {k}: {ma[k]} != {mb[k]}")
            sys.exit(1)
    worst = 0.0
    for l in range(ma["layers"]):
        ta, tb = load(a.a, ma["files"][l]), load(a.b, mb["files"][l])
        for k in ("attn_in", "o_in", "mlp_in", "down_in"):
            x, y = ta[k].astype(np.float64), tb[k].astype(np.float64)
            if x.shape != y.shape:
                print(f"layer {l} {k}: shape {x.shape} != {y.shape}")
                sys.exit(1)
            e = float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30))
            worst = max(worst, e)
            print(f"layer {l} {k:8s} rel err {e:.3e}")
        if not np.array_equal(ta["position_ids"].astype(np.int64), tb["position_ids"].astype(np.int64)):
            print(f"layer {l}: position_ids differ")
            sys.exit(1)
    print(f"worst {worst:.3e} (tol {a.tol:g})")
    sys.exit(0 if worst <= a.tol else 1)


if __name__ == "__main__":
    main()
