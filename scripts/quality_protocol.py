#!/usr/bin/env python3
"""Quality protocol: many paired draws per Hessian kind, not one run.

One quantization run is one sample from a wide band (rounding noise, the
calibration subset). This script runs D draws; draw d uses its own calibration
subset (N sequences chosen from a pool with seed d, without replacement) and
every variant of a draw sees the same subset, so variants can be compared
draw by draw (paired). For every draw and variant it runs

    bakron quantize MODEL --calib OUT/calib-d.safetensors --hessian V --out ... [options]
    bakron eval OUT/q-d-V --tokens EVAL --json

and then reports per variant: mean perplexity, its standard error over draws
(sample standard deviation / sqrt(D)), the fraction of GPTQ's gap to FP
closed (per draw: (ppl_gptq - ppl_v) / (ppl_gptq - ppl_fp), then mean and
standard error), and the paired wins against GPTQ (draws where ppl_v < ppl_gptq).

    scripts/quality_protocol.py --bakron build/bakron --model data/smollm2/model \\
        --pool data/smollm2/calib-pool-512.safetensors --samples 128 \\
        --eval data/smollm2/eval.safetensors --draws 10 \\
        --variants gptq,mlplocal-kfac,fullylocal-kfac --out out/quality-512 -- --levels 3

--jobs J runs J draw/variant jobs at once (a small model leaves most of a big GPU
idle); the quantize times in the summary are then measured under that load and say so.

It is resumable: a draw/variant whose eval JSON exists is not run again (so a
long protocol can be spread over several calls). --report-only prints the
tables from what is there. Output: OUT/summary.md and OUT/summary.json.

The pool is a token file (I32/I64 `input_ids` [P, T]) with at least N rows;
draws overlap when P < D*N (they are then not independent: say so with the
numbers; the script prints the pool size and the expected overlap).
"""
import argparse
import concurrent.futures
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


def eval_ppl(bakron, model, evalf, out_json, log):
    if not os.path.exists(out_json):
        with open(out_json + ".tmp", "w") as f, open(log, "w") as lg:
            r = subprocess.run([bakron, "eval", model, "--tokens", evalf, "--json"], stdout=f, stderr=lg)
        if r.returncode != 0:
            raise Failed(f"quality_protocol: eval of {model} failed (exit {r.returncode}); log {log}")
        os.replace(out_json + ".tmp", out_json)
    with open(out_json) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    for obj in reversed(lines):
        if "perplexity" in obj:
            return float(obj["perplexity"])
    raise Failed(f"quality_protocol: no perplexity in {out_json}")


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bakron", default="build/bakron")
    ap.add_argument("--model", required=True)
    ap.add_argument("--pool", required=True, help="token file the calibration subsets are drawn from")
    ap.add_argument("--samples", type=int, required=True, help="sequences per draw")
    ap.add_argument("--eval", required=True, help="evaluation token file")
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
    fp = None
    if not a.report_only:
        fp = eval_ppl(a.bakron, a.model, a.eval, f"{a.out}/eval-fp.json", f"{a.out}/eval-fp.log")
        pool_n = load_file(a.pool)["input_ids"].shape[0]
        print(f"pool {a.pool}: {pool_n} sequences; {a.draws} draws of {a.samples}"
              f" ({'disjoint possible' if pool_n >= a.draws * a.samples else 'draws overlap'};"
              f" expected overlap of two draws {a.samples * a.samples / pool_n:.1f} sequences)", flush=True)
        todo = []
        for d in range(a.first_draw, a.first_draw + a.draws):
            calib = f"{a.out}/calib-{d}.safetensors"
            make_subset(a.pool, a.samples, d, calib)
            todo += [(d, v, calib) for v in variants if not os.path.exists(f"{a.out}/eval-{d}-{v}.json")]

        def job(d, v, calib):
            if a.deadline and time.time() - t_start > a.deadline:
                return None
            q = f"{a.out}/q-{d}-{v}"
            t0 = time.time()
            run([a.bakron, "quantize", a.model, "--calib", calib, "--hessian", v, "--out", q,
                 "--overwrite"] + a.quantize_args, f"{a.out}/quantize-{d}-{v}.log")
            tq = time.time() - t0
            ppl = eval_ppl(a.bakron, q, a.eval, f"{a.out}/eval-{d}-{v}.json", f"{a.out}/eval-{d}-{v}.log")
            with open(f"{a.out}/time-{d}-{v}.txt", "w") as f:
                f.write(f"{tq:.2f} {a.jobs}\n")
            print(f"draw {d} {v}: perplexity {ppl:.4f} (quantize {tq:.1f} s, {a.jobs} jobs at once)", flush=True)
            if not a.keep:
                subprocess.run(["rm", "-rf", q])
            return ppl

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
    fp = eval_ppl(a.bakron, a.model, a.eval, f"{a.out}/eval-fp.json", f"{a.out}/eval-fp.log")
    # collect the draws where every variant is present
    res = {}
    for d in range(a.first_draw, a.first_draw + a.draws):
        row = {}
        for v in variants:
            ej = f"{a.out}/eval-{d}-{v}.json"
            if os.path.exists(ej):
                row[v] = eval_ppl(a.bakron, None, None, ej, None)
        if len(row) == len(variants):
            res[d] = row
    draws = sorted(res)
    summary = {"fp_perplexity": fp, "draws": draws, "samples": a.samples, "pool": a.pool,
               "quantize_args": a.quantize_args, "variants": {}, "per_draw": {str(d): res[d] for d in draws}}
    lines = [f"FP perplexity {fp:.4f}; {len(draws)} complete draws of {a.samples} sequences from {a.pool};"
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
        tl = [open(f"{a.out}/time-{d}-{v}.txt").read().split() for d in draws
              if os.path.exists(f"{a.out}/time-{d}-{v}.txt")]
        ts = [float(t[0]) for t in tl]
        jobs = sorted({int(t[1]) if len(t) > 1 else 1 for t in tl})
        tmean = f"{sum(ts) / len(ts):.1f}" if ts else ""
        if jobs and jobs != [1]:
            tmean += f" ({'/'.join(map(str, jobs))} jobs at once)"
        summary["variants"][v] = ent
        lines.append(f"| {v} | {m:.3f} | {sd:.3f} | {se:.3f} | {closed} | {wins} | {tmean} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(f"{a.out}/summary.md", "w") as f:
        f.write(text)
    with open(f"{a.out}/summary.json", "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
