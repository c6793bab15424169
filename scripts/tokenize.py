#!/usr/bin/env python3
"""Turn text files into a bakron token file: a safetensors file holding an
I32 tensor `input_ids` [sequences, seqlen].

The text of all inputs is concatenated (documents separated by a blank
line, or by the token --doc-sep ID), tokenized with the model's Hugging Face
tokenizer (or as raw bytes with --byte-level, token id = byte value, as the
bundled kerneldocs-1.6m model expects), and cut into non-overlapping windows
of --seqlen tokens, each starting with the BOS token when the tokenizer has
one. Windows are taken in
order, or sampled with a fixed seed (--shuffle).

    scripts/tokenize.py --model MODEL_DIR --seqlen 512 --samples 128 \
        --out calib.safetensors docs/*.txt

`bakron quantize --calib-text` and `bakron eval --text` make the same windows
in C from the model's tokenizer.json (default options: in order, BOS from
config.json, documents separated by a blank line; docs/tokenizer.md), so this
script is needed only for --shuffle, --bos, --doc-sep or --byte-level.

Note: this file's name shadows the standard library's `tokenize` module for
scripts run from this folder; scripts/ is removed from sys.path below.
"""
import argparse
import json
import os
import random
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def die(msg):
    print(f"tokenize.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="text files (or folders, read recursively)")
    ap.add_argument("--model", help="model folder with a Hugging Face tokenizer (tokenizer.json)")
    ap.add_argument("--byte-level", action="store_true", help="token id = byte value (kerneldocs-1.6m)")
    ap.add_argument("--bos", type=int, default=None, help="BOS token id (default: the tokenizer's; 1 with --byte-level)")
    ap.add_argument("--no-bos", action="store_true", help="do not start windows with BOS")
    ap.add_argument("--doc-sep", type=int, default=None,
                    help="token id placed between documents (default: the tokens of a blank line)")
    ap.add_argument("--seqlen", type=int, required=True)
    ap.add_argument("--samples", type=int, default=0, help="number of windows (0 = all)")
    ap.add_argument("--shuffle", action="store_true", help="sample windows at random (seed --seed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    files = []
    for p in a.inputs:
        if os.path.isdir(p):
            for root, _, names in os.walk(p):
                files += [os.path.join(root, n) for n in sorted(names)]
        elif os.path.isfile(p):
            files.append(p)
        else:
            die(f"{p}: no such file or folder")
    files.sort()
    if not files:
        die("no input files")
    if a.seqlen < 2:
        die("--seqlen must be at least 2")

    bos = a.bos
    if a.byte_level:
        if bos is None:
            bos = 1
        ids = []
        for f in files:
            with open(f, "rb") as fh:
                ids += list(fh.read()) + ([a.doc_sep] if a.doc_sep is not None else [10, 10])
    else:
        if not a.model:
            die("--model MODEL_DIR (with a tokenizer) or --byte-level is required")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            die("the Python package 'tokenizers' is required (pip install tokenizers)")
        tj = os.path.join(a.model, "tokenizer.json")
        if not os.path.isfile(tj):
            die(f"{tj}: not found")
        tok = Tokenizer.from_file(tj)
        if bos is None:
            cfgp = os.path.join(a.model, "config.json")
            if os.path.isfile(cfgp):
                with open(cfgp) as fh:
                    bos = json.load(fh).get("bos_token_id")
        vocab = tok.get_vocab_size(with_added_tokens=True)
        for name, v in (("--bos", bos), ("--doc-sep", a.doc_sep)):
            if v is not None and not 0 <= v < vocab:
                die(f"{name} {v} is outside the tokenizer's vocabulary [0, {vocab})")
        sep = [a.doc_sep] if a.doc_sep is not None else \
            tok.encode("\n\n", add_special_tokens=False).ids
        ids = []
        for f in files:
            with open(f, "r", encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            ids += tok.encode(text, add_special_tokens=False).ids + sep
    use_bos = bos is not None and not a.no_bos
    body = a.seqlen - 1 if use_bos else a.seqlen
    nwin = len(ids) // body
    if nwin == 0:
        die(f"only {len(ids)} tokens: not enough for one window of {a.seqlen}")
    order = list(range(nwin))
    if a.shuffle:
        random.Random(a.seed).shuffle(order)
    if a.samples:
        if a.samples > nwin:
            die(f"asked for {a.samples} windows, the text gives {nwin}")
        order = sorted(order[: a.samples]) if not a.shuffle else order[: a.samples]
    import numpy as np
    from safetensors.numpy import save_file
    rows = []
    for w in order:
        chunk = ids[w * body:(w + 1) * body]
        rows.append(([bos] if use_bos else []) + chunk)
    arr = np.asarray(rows, dtype=np.int32)
    tmp = a.out + ".tmp"
    save_file({"input_ids": arr}, tmp, metadata={
        "format": "pt", "source": ",".join(os.path.basename(f) for f in files[:20]) + ("..." if len(files) > 20 else ""),
        "tokenizer": "byte-level" if a.byte_level else os.path.abspath(a.model),
        "total_tokens": str(len(ids)), "documents": str(len(files)),
        "windows_available": str(nwin), "seqlen": str(a.seqlen),
        "bos": "none" if not use_bos else str(bos),
        "doc_sep": "blank line" if a.doc_sep is None else str(a.doc_sep),
        "sampling": f"shuffle seed {a.seed}" if a.shuffle else "in order"})
    os.replace(tmp, a.out)
    print(f"{a.out}: input_ids [{arr.shape[0]}, {arr.shape[1]}] from {len(files)} files, "
          f"{len(ids)} tokens ({nwin} windows available)")


if __name__ == "__main__":
    main()
