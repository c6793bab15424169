#!/usr/bin/env python3
"""Paired comparisons across quality-protocol folders (scripts/quality_protocol.py).

Two protocol runs with the same --pool, --samples and draws (draw d = the same
calibration subset in both) can be compared draw by draw even when they were
made with different quantize options (e.g. --damp 0.1 against the default).
Each argument is FOLDER:VARIANT (FOLDER's summary.json, first evaluation file).

    scripts/quality_compare.py --ref data/qa-gptq:backprop-kfac \\
        --gptq data/qa-a01:gptq data/qa-db2:backprop-kfac data/qa-a01b2:backprop-kfac

For every FOLDER:VARIANT: mean perplexity and standard error over the draws the
runs have in common; with --ref, the paired difference to the reference (mean ±
se, and on how many draws it is lower); with --gptq, the fraction of that GPTQ's
gap to FP closed per draw (mean ± se) and the wins against it. The FP perplexity
is taken from the folders (they must agree: the same evaluation tokens).
"""
import argparse
import json
import math
import os
import sys


def load(spec):
    folder, _, variant = spec.rpartition(":")
    if not folder:
        sys.exit(f"quality_compare: {spec}: expected FOLDER:VARIANT")
    path = os.path.join(folder, "summary.json")
    try:
        with open(path) as f:
            s = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"quality_compare: {path}: {e}")
    per = {int(d): row[variant] for d, row in s.get("per_draw", {}).items() if variant in row}
    if not per:
        sys.exit(f"quality_compare: {path}: no draws of variant '{variant}'")
    return {"name": spec, "fp": s.get("fp_perplexity"), "eval": s.get("eval"),
            "samples": s.get("samples"), "pool": s.get("pool"), "per": per}


def stats(xs):
    n = len(xs)
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else float("nan")
    return m, sd, sd / math.sqrt(n)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", help="FOLDER:VARIANT the others are compared with, draw by draw")
    ap.add_argument("--gptq", help="FOLDER:VARIANT whose gap to FP is measured (usually a gptq run)")
    ap.add_argument("runs", nargs="+", help="FOLDER:VARIANT")
    a = ap.parse_args()
    runs = [load(r) for r in a.runs]
    ref = load(a.ref) if a.ref else None
    gq = load(a.gptq) if a.gptq else None
    every = runs + [x for x in (ref, gq) if x]
    for key in ("fp", "samples", "pool"):
        vals = {json.dumps(x[key]) for x in every}
        if len(vals) > 1:
            sys.exit(f"quality_compare: the folders differ in {key}: "
                     + ", ".join(f"{x['name']}={x[key]}" for x in every))
    fp = every[0]["fp"]
    draws = sorted(set.intersection(*(set(x["per"]) for x in every)))
    if len(draws) < 2:
        sys.exit(f"quality_compare: only {len(draws)} draw(s) in common")
    print(f"{len(draws)} paired draws ({', '.join(map(str, draws))}); FP perplexity {fp:.4f}")
    head = "| run | mean ppl | se |"
    if ref:
        head += f" vs {ref['name']} (mean ± se) | lower on |"
    if gq:
        head += f" gap closed vs {gq['name']} | wins |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in runs:
        xs = [r["per"][d] for d in draws]
        m, _, se = stats(xs)
        line = f"| {r['name']} | {m:.3f} | {se:.3f} |"
        if ref:
            dm, _, dse = stats([r["per"][d] - ref["per"][d] for d in draws])
            low = sum(1 for d in draws if r["per"][d] < ref["per"][d])
            line += f" {dm:+.3f} ± {dse:.3f} | {low}/{len(draws)} |"
        if gq:
            cl = [(gq["per"][d] - r["per"][d]) / (gq["per"][d] - fp) for d in draws]
            cm, _, cse = stats(cl)
            w = sum(1 for d in draws if r["per"][d] < gq["per"][d])
            line += f" {100 * cm:+.1f}% ± {100 * cse:.1f}% | {w}/{len(draws)} |"
        print(line)


if __name__ == "__main__":
    main()
