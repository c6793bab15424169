#!/usr/bin/env python3
"""Quality protocol: many paired draws per Hessian kind, not one run.

One quantization run is one sample from a wide band (rounding noise, the
calibration subset). This script runs D draws; draw d uses its own calibration
subset (N sequences chosen from a pool with seed d, without replacement) and
every variant of a draw sees the same subset, so variants can be compared
draw by draw (paired). For every draw and variant it runs

    bakron quantize MODEL --calib OUT/calib-d.safetensors --hessian V --out ... [options]
    bakron eval OUT/q-d-V --tokens EVAL --json          (for every --eval file)

and then reports, per evaluation file and variant: mean perplexity, its standard
error over draws (sample standard deviation / sqrt(D)), the fraction of GPTQ's gap
to FP closed (per draw: (ppl_gptq - ppl_v) / (ppl_gptq - ppl_fp), then mean and
standard error), and the paired wins against GPTQ (draws where ppl_v < ppl_gptq).

--eval may be given more than once (e.g. the same held-out text in windows of 512
and of 2048 tokens): every quantized model is evaluated on every file, and each
file gets its own table. The first evaluation file of a folder keeps the
original names (OUT/eval-fp.json, OUT/eval-d-V.json); every further file has a
folder of its own, OUT/evals/STEM/ (STEM: the file name without .safetensors),
with the same names inside. OUT/eval-files.json records which tokens (the
SHA-256 of the input_ids) each of them holds: a file is recognized by its
tokens, whatever its path or its place on the command line, and other tokens
under a known name get a new folder (OUT/evals/STEM-2/). In a folder written
before eval-files.json existed, the first --eval is taken to be the file its
results are of (checked: the same sequences x seqlen).

    scripts/quality_protocol.py --bakron build/bakron --model data/smollm2/model \\
        --pool data/smollm2/pool-512.safetensors --samples 256 \\
        --eval data/smollm2/eval.safetensors --eval data/smollm2/eval-2048.safetensors --draws 10 \\
        --variants gptq,mlplocal-kfac,fullylocal-kfac --out out/quality-512 -- --levels 3

--jobs J runs J draw/variant jobs at once (a small model leaves most of a big GPU
idle); the quantize times in the summary are then measured under that load and say so.

It is resumable: a draw/variant whose eval JSONs all exist is not run again (so a
long protocol can be spread over several calls). An evaluation file added to an
existing folder is evaluated on the kept checkpoints (--keep) or, where they were
deleted, on checkpoints quantized again from the same calibration subset; such a
re-made checkpoint is also evaluated again on one file it already has a result
for, and OUT/recheck-d-V.txt says whether the perplexity came out identical
(i.e. whether the re-made checkpoint is the one evaluated before; the stored
result is kept either way). --report-only prints the tables from what is there.
Output: OUT/summary.md and OUT/summary.json (its top-level fields are those of
the first --eval, as before; "evals" holds every file's).

The pool is a token file (I32/I64 `input_ids` [P, T]) with at least N rows;
draws overlap when P < D*N (they are then not independent: say so with the
numbers; the script prints the pool size and the expected overlap).
"""
import argparse
import concurrent.futures
import hashlib
import json
import math
import os
import subprocess
import sys
import time

if sys.path and os.path.basename(sys.path[0]) == "scripts":
    sys.path.pop(0)  # scripts/tokenize.py shadows the standard library module

import numpy as np
from safetensors.numpy import load_file, save_file


class Failed(Exception):
    pass


def run(cmd, log):
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        tail = open(log).read()[-2000:]
        raise Failed(f"quality_protocol: {' '.join(cmd)} failed (exit {r.returncode}); log {log}:\n{tail}")


def read_ppl(out_json):
    with open(out_json) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    for obj in reversed(lines):
        if "perplexity" in obj:
            return float(obj["perplexity"])
    raise Failed(f"quality_protocol: no perplexity in {out_json}")


def eval_ppl(bakron, model, evalf, out_json, log):
    if not os.path.exists(out_json):
        with open(out_json + ".tmp", "w") as f, open(log, "w") as lg:
            r = subprocess.run([bakron, "eval", model, "--tokens", evalf, "--json"], stdout=f, stderr=lg)
        if r.returncode != 0:
            raise Failed(f"quality_protocol: eval of {model} on {evalf} failed (exit {r.returncode}); log {log}")
        os.replace(out_json + ".tmp", out_json)
    return read_ppl(out_json)


def make_subset(pool, n, seed, path):
    if os.path.exists(path):
        return
    ids = load_file(pool)["input_ids"]
    if ids.shape[0] < n:
        sys.exit(f"quality_protocol: {pool}: {ids.shape[0]} sequences, --samples {n} needs at least that many")
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(ids.shape[0], size=n, replace=False))
    save_file({"input_ids": np.ascontiguousarray(ids[rows])}, path + ".tmp")
    os.replace(path + ".tmp", path)


def stats(xs):
    n = len(xs)
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else float("nan")
    return m, sd, sd / math.sqrt(n) if n > 1 else float("nan")


class Slot:
    """One evaluation file and the folder holding its results (OUT itself for
    the folder's first evaluation file, else OUT/evals/STEM)."""

    def __init__(self, out, path, sub, shape):
        self.path, self.sub, self.shape = path, sub, shape
        self.dir = os.path.join(out, sub) if sub else out

    def json(self, d, v):
        return os.path.join(self.dir, f"eval-{d}-{v}.json")

    def log(self, d, v):
        return os.path.join(self.dir, f"eval-{d}-{v}.log")

    def fp(self, bakron, model):
        return eval_ppl(bakron, model, self.path, os.path.join(self.dir, "eval-fp.json"),
                        os.path.join(self.dir, "eval-fp.log"))


def eval_slots(out, evals):
    """The Slot of every --eval file, in command-line order. A file is known by
    the SHA-256 of its input_ids (int32 little-endian bytes, as
    scripts/prepare_text.py's stats.json), whatever its path; OUT/eval-files.json
    records them."""
    mpath = os.path.join(out, "eval-files.json")
    recs = []
    if os.path.exists(mpath):
        with open(mpath) as f:
            recs = json.load(f)["files"]
    slots = []
    for path in evals:
        ids = load_file(path)["input_ids"]
        shape = [int(x) for x in ids.shape]
        sha = hashlib.sha256(np.ascontiguousarray(ids.astype("<i4")).tobytes()).hexdigest()
        rec = next((r for r in recs if r["input_ids_sha256"] == sha), None)
        if rec is None:
            if not any(r["dir"] == "" for r in recs):
                sub = ""
                old = os.path.join(out, "eval-fp.json")
                if os.path.exists(old):
                    # a folder of the one-file version of this script: its results
                    # are taken to be of this file when the shape agrees
                    with open(old) as f:
                        o = [json.loads(l) for l in f if l.strip()][-1]
                    if [o.get("sequences"), o.get("seqlen")] != shape:
                        sys.exit(f"quality_protocol: {old} was evaluated on {o.get('sequences')} x "
                                 f"{o.get('seqlen')} tokens ({o.get('tokens_file')}), the first --eval "
                                 f"{path} is {shape[0]} x {shape[1]}: give that file first")
            else:
                stem = os.path.basename(path)
                if stem.endswith(".safetensors"):
                    stem = stem[:-len(".safetensors")]
                stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem) or "eval"
                sub, k = os.path.join("evals", stem), 2
                while any(r["dir"] == sub for r in recs):
                    sub, k = os.path.join("evals", f"{stem}-{k}"), k + 1
            rec = {"dir": sub, "path": path, "shape": shape, "input_ids_sha256": sha}
            recs.append(rec)
        if any(s.sub == rec["dir"] for s in slots):
            sys.exit(f"quality_protocol: --eval {path}: the same tokens as an earlier --eval")
        s = Slot(out, path, rec["dir"], shape)
        os.makedirs(s.dir, exist_ok=True)
        slots.append(s)
    with open(mpath + ".tmp", "w") as f:
        json.dump({"files": recs}, f, indent=1)
    os.replace(mpath + ".tmp", mpath)
    return slots


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bakron", default="build/bakron")
    ap.add_argument("--model", required=True)
    ap.add_argument("--pool", required=True, help="token file the calibration subsets are drawn from")
    ap.add_argument("--samples", type=int, required=True, help="sequences per draw")
    ap.add_argument("--eval", required=True, action="append",
                    help="evaluation token file (repeat for more than one: a table each)")
    ap.add_argument("--draws", type=int, default=10)
    ap.add_argument("--first-draw", type=int, default=0, help="seed of the first draw")
    ap.add_argument("--variants", default="gptq,mlplocal-kfac,fullylocal-kfac")
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the quantized checkpoints")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--deadline", type=float, default=0,
                    help="stop starting new runs after this many seconds (resume later)")
    ap.add_argument("--jobs", type=int, default=1, help="draw/variant jobs run at once")
    ap.add_argument("quantize_args", nargs="*", help="after --: options for bakron quantize")
    a = ap.parse_args()
    variants = a.variants.split(",")
    os.makedirs(a.out, exist_ok=True)
    t_start = time.time()
    slots = eval_slots(a.out, a.eval)
    draw_range = range(a.first_draw, a.first_draw + a.draws)
    if not a.report_only:
        for s in slots:
            s.fp(a.bakron, a.model)
        pool_n = load_file(a.pool)["input_ids"].shape[0]
        print(f"pool {a.pool}: {pool_n} sequences; {a.draws} draws of {a.samples}"
              f" ({'disjoint possible' if pool_n >= a.draws * a.samples else 'draws overlap'};"
              f" expected overlap of two draws {a.samples * a.samples / pool_n:.1f} sequences)", flush=True)
        todo = []
        for d in draw_range:
            calib = f"{a.out}/calib-{d}.safetensors"
            make_subset(a.pool, a.samples, d, calib)
            todo += [(d, v, calib) for v in variants if not all(os.path.exists(s.json(d, v)) for s in slots)]

        def job(d, v, calib):
            if a.deadline and time.time() - t_start > a.deadline:
                return None
            q = f"{a.out}/q-{d}-{v}"
            tfile = f"{a.out}/time-{d}-{v}.txt"
            have = [s for s in slots if os.path.exists(s.json(d, v))]
            remade = False
            # the time file is written once quantize has succeeded: a kept
            # checkpoint (--keep) with one is complete
            if not (os.path.isdir(q) and os.path.exists(tfile)):
                if os.path.exists(tfile):
                    os.remove(tfile)
                t0 = time.time()
                run([a.bakron, "quantize", a.model, "--calib", calib, "--hessian", v, "--out", q,
                     "--overwrite"] + a.quantize_args, f"{a.out}/quantize-{d}-{v}.log")
                with open(tfile, "w") as f:
                    f.write(f"{time.time() - t0:.2f} {a.jobs}\n")
                remade = bool(have)
            tq = float(open(tfile).read().split()[0])
            ppls = [(s, eval_ppl(a.bakron, q, s.path, s.json(d, v), s.log(d, v))) for s in slots]
            note = ""
            if remade:
                # the checkpoint was deleted after the earlier evaluations and made
                # again for the new file: is it the same checkpoint?
                s = have[0]
                rj = s.json(d, v) + ".recheck"
                if os.path.exists(rj):
                    os.remove(rj)
                old = read_ppl(s.json(d, v))
                new = eval_ppl(a.bakron, q, s.path, rj, s.log(d, v) + ".recheck")
                same = "identical" if new == old else "DIFFERS"
                with open(f"{a.out}/recheck-{d}-{v}.txt", "w") as f:
                    f.write(f"{same} {old!r} {new!r} {s.path}\n")
                note = f"; re-made checkpoint on {s.path}: {new:.4f} vs stored {old:.4f}, {same}"
            print(f"draw {d} {v}: perplexity " + ", ".join(f"{p:.4f} on {s.path}" for s, p in ppls) +
                  f" (quantize {tq:.1f} s, {a.jobs} jobs at once{note})", flush=True)
            if not a.keep:
                subprocess.run(["rm", "-rf", q])
            return True

        failed = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as ex:
            futs = [ex.submit(job, *t) for t in todo]
            for fu in futs:
                try:
                    if fu.result() is None and not failed:
                        failed.append("deadline reached; run again to continue")
                except Failed as e:
                    failed.append(str(e))
        if failed:
            print(failed[0], flush=True)
            if not failed[0].startswith("deadline"):
                sys.exit(failed[0])

    # quantize times (the same checkpoints for every evaluation file)
    tcol = {}
    for v in variants:
        tl = [open(f"{a.out}/time-{d}-{v}.txt").read().split() for d in draw_range
              if os.path.exists(f"{a.out}/time-{d}-{v}.txt")]
        ts = [float(t[0]) for t in tl]
        jobs = sorted({int(t[1]) if len(t) > 1 else 1 for t in tl})
        tcol[v] = f"{sum(ts) / len(ts):.1f}" if ts else ""
        if jobs and jobs != [1]:
            tcol[v] += f" ({'/'.join(map(str, jobs))} jobs at once)"
    lines, evals = [], []
    for s in slots:
        fp = s.fp(a.bakron, a.model)
        # the draws where every variant is present
        res = {}
        for d in draw_range:
            row = {v: read_ppl(s.json(d, v)) for v in variants if os.path.exists(s.json(d, v))}
            if len(row) == len(variants):
                res[d] = row
        draws = sorted(res)
        ent_eval = {"eval": s.path, "results": s.sub or ".", "shape": s.shape, "fp_perplexity": fp,
                    "draws": draws, "variants": {}, "per_draw": {str(d): res[d] for d in draws}}
        if lines:
            lines.append("")
        lines += [f"Evaluation {s.path} ({s.shape[0]} x {s.shape[1]} tokens): FP perplexity {fp:.4f};"
                  f" {len(draws)} complete draws of {a.samples} sequences from {a.pool};"
                  f" quantize options: {' '.join(a.quantize_args) or '(defaults)'}", "",
                  "| variant | mean ppl | sd | se | gap to FP closed vs GPTQ (mean ± se) | paired wins vs GPTQ | mean quantize s |",
                  "|---|---|---|---|---|---|---|"]
        for v in variants:
            xs = [res[d][v] for d in draws]
            if not xs:
                continue
            m, sd, se = stats(xs)
            ent = {"mean": m, "sd": sd, "se": se}
            closed = wins = ""
            if "gptq" in variants and v != "gptq":
                cl = [(res[d]["gptq"] - res[d][v]) / (res[d]["gptq"] - fp) for d in draws]
                cm, _, cse = stats(cl)
                w = sum(1 for d in draws if res[d][v] < res[d]["gptq"])
                ent.update({"gap_closed_mean": cm, "gap_closed_se": cse, "wins_vs_gptq": w})
                closed = f"{100 * cm:+.1f}% ± {100 * cse:.1f}%"
                wins = f"{w}/{len(draws)}"
            ent_eval["variants"][v] = ent
            lines.append(f"| {v} | {m:.3f} | {sd:.3f} | {se:.3f} | {closed} | {wins} | {tcol[v]} |")
        evals.append(ent_eval)
    rechecks = [open(f"{a.out}/recheck-{d}-{v}.txt").read().split()[0] for d in draw_range for v in variants
                if os.path.exists(f"{a.out}/recheck-{d}-{v}.txt")]
    if rechecks:
        nid = rechecks.count("identical")
        lines += ["", f"{len(rechecks)} checkpoints were quantized again for a later evaluation file;"
                  f" evaluated again on an earlier file, {nid} gave the identical perplexity and"
                  f" {len(rechecks) - nid} did not (OUT/recheck-D-V.txt)"]
    first = evals[0]
    summary = {"fp_perplexity": first["fp_perplexity"], "draws": first["draws"], "samples": a.samples,
               "pool": a.pool, "eval": first["eval"], "quantize_args": a.quantize_args,
               "variants": first["variants"], "per_draw": first["per_draw"], "evals": evals}
    if rechecks:
        summary["rechecks"] = {"identical": rechecks.count("identical"),
                               "differ": len(rechecks) - rechecks.count("identical")}
    text = "\n".join(lines) + "\n"
    print(text)
    with open(f"{a.out}/summary.md", "w") as f:
        f.write(text)
    with open(f"{a.out}/summary.json", "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
