#!/usr/bin/env bash
# Quantize a model with every --hessian at one quantizer setting and report
# perplexity, summed proxy losses and wall time as a markdown table.
#
#   scripts/bench_quality.sh MODEL_DIR CALIB.safetensors EVAL.safetensors OUT_DIR [quantize options...]
#
# e.g. scripts/bench_quality.sh examples/kerneldocs-1.6m examples/kerneldocs-1.6m/calib.safetensors \
#        examples/kerneldocs-1.6m/eval.safetensors out/bench --levels 3
# Environment: BAKRON (default ./build/bakron), HESSIANS (default: all six).
set -euo pipefail
[ $# -ge 4 ] || { sed -n '2,10p' "$0"; exit 1; }
model=$1 calib=$2 evalf=$3 out=$4
shift 4
B=${BAKRON:-./build/bakron}
hessians=${HESSIANS:-"rtn gptq mlplocal-kfac mlplocal-shampoo fullylocal-kfac fullylocal-shampoo"}
mkdir -p "$out"
"$B" eval "$model" --tokens "$evalf" --json > "$out/eval-fp.json"
for h in $hessians; do
    t0=$(date +%s.%N)
    "$B" quantize "$model" --calib "$calib" --hessian "$h" --out "$out/$h" --overwrite "$@" \
        2> "$out/$h.log"
    t1=$(date +%s.%N)
    echo "$t0 $t1" > "$out/$h.time"
    "$B" eval "$out/$h" --tokens "$evalf" --json > "$out/eval-$h.json"
done
python3 - "$out" "$hessians" <<'PY'
import json, os, sys
out, hs = sys.argv[1], sys.argv[2].split()
fp = json.load(open(f"{out}/eval-fp.json"))["perplexity"]
rows = []
g = None
for h in hs:
    ppl = json.load(open(f"{out}/eval-{h}.json"))["perplexity"]
    rep = json.load(open(f"{out}/{h}/report.json"))
    t0, t1 = map(float, open(f"{out}/{h}.time").read().split())
    lg = sum(m["loss_gptq"] or 0 for m in rep["modules"])
    lo = sum(m["loss"] or 0 for m in rep["modules"] if m.get("two_sided"))
    ts = rep["times_s"]
    rows.append((h, ppl, lg, lo, t1 - t0, ts))
    if h == "gptq":
        g = ppl
print(f"| Hessian | perplexity | gap to FP closed vs GPTQ | Σ GPTQ proxy loss tr(EAEᵀ) | Σ two-sided loss (own B) | time (s) | forward / hessian / cholesky / solve (s) |")
print("|---|---|---|---|---|---|---|")
print(f"| FP (unquantized) | {fp:.4f} | | | | | |")
for h, ppl, lg, lo, t, ts in rows:
    closed = "" if g is None or h in ("gptq",) or g == fp else f"{100*(g-ppl)/(g-fp):+.1f}%"
    print(f"| {h} | {ppl:.4f} | {closed} | {lg:.4g} | {lo:.4g} | {t:.1f} | "
          f"{ts['forward']:.1f} / {ts['hessian']:.1f} / {ts['factor']:.1f} / {ts['solve']:.1f} |")
PY
