#!/usr/bin/env python3
"""Keep the first sequences of a transformers golden file (golden.safetensors,
described in tests/data/models/GOLDEN-README.md) so that it is small enough to
live in the repository.

Every tensor in a golden file has the batch (sequence) axis first:
input_ids [batch, seq], logits [batch, seq, vocab], layers.* [batch, seq, width].
Under causal attention the sequences of a batch do not interact, so the slice
is exactly what transformers would have produced for the kept sequences alone.

usage: scripts/slice_golden.py IN.safetensors OUT.safetensors [--sequences N]
       [--max-bytes B]

Needs numpy and safetensors (pip install numpy safetensors).
"""
import argparse
import os
import sys
import tempfile


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="golden.safetensors to slice")
    ap.add_argument("dst", help="output file")
    ap.add_argument("--sequences", type=int, default=1,
                    help="number of leading sequences to keep (default 1)")
    ap.add_argument("--max-bytes", type=int, default=3 * 1024 * 1024,
                    help="refuse to write a file larger than this (default 3 MiB)")
    a = ap.parse_args(argv)

    try:
        from safetensors import safe_open
        from safetensors.numpy import save_file
    except ImportError:
        sys.exit("slice_golden.py: needs the 'safetensors' and 'numpy' Python packages")

    if a.sequences < 1:
        sys.exit(f"slice_golden.py: --sequences must be >= 1 (got {a.sequences})")

    out = {}
    with safe_open(a.src, "np") as f:
        meta = dict(f.metadata() or {})
        keys = list(f.keys())
        if "input_ids" not in keys:
            sys.exit(f"{a.src}: no tensor 'input_ids': not a golden file")
        batch = f.get_tensor("input_ids").shape[0]
        if a.sequences > batch:
            sys.exit(f"{a.src}: holds {batch} sequences, cannot keep {a.sequences}")
        for k in keys:
            t = f.get_tensor(k)
            if t.ndim < 2 or t.shape[0] != batch:
                sys.exit(f"{a.src}: tensor '{k}' has shape {list(t.shape)}, expected the "
                         f"batch axis ({batch}) first")
            out[k] = t[: a.sequences].copy()

    total = sum(v.nbytes for v in out.values())
    if total > a.max_bytes:
        sys.exit(f"slice_golden.py: {a.sequences} sequence(s) take {total} bytes, more than "
                 f"--max-bytes {a.max_bytes}")
    meta["sliced_from"] = os.path.basename(a.src)
    meta["sliced_sequences"] = f"{a.sequences} of {batch}"

    d = os.path.dirname(os.path.abspath(a.dst))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".slice-", dir=d)
    os.close(fd)
    try:
        save_file(out, tmp, metadata=meta)
        os.replace(tmp, a.dst)
    except BaseException:
        os.unlink(tmp)
        raise
    print(f"{a.dst}: {len(out)} tensors, {a.sequences} of {batch} sequences, "
          f"{os.path.getsize(a.dst)} bytes")


if __name__ == "__main__":
    main()
