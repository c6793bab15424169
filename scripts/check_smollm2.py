#!/usr/bin/env python3
"""Verify the SmolLM2 checkpoint written by scripts/fetch_smollm2.py against
transformers' own reading of the GGUF, and bakron's native forward pass
against transformers.

Checks (each prints one line; any failure -> exit 2 naming the check):
  permutation  the inverse RoPE row permutation undoes llama.cpp's forward
               permutation, written here element by element
  config       config.json agrees with transformers' config read from the GGUF
  weights      every tensor of model.safetensors equals the tensor that
               transformers dequantizes and un-permutes from the GGUF itself
  tokenizer    tokenizer.json has the GGUF's vocabulary and merges; it encodes
               sample texts exactly as transformers' GGUF tokenizer does, and
               decode(encode(text)) == text
  logits       transformers (GGUF, float32, CPU) vs `bakron eval --logits-out`
               on the first --logit-samples evaluation sequences
  perplexity   transformers vs `bakron eval` on all evaluation sequences

    scripts/check_smollm2.py --model data/smollm2/model --tokens data/smollm2/eval.safetensors \\
        --bakron build-smol/bakron --json-out data/smollm2/check.json
"""
import argparse
import glob
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
REPO_ROOT = os.path.dirname(_HERE)

LOGIT_RTOL = 1e-4   # max |bakron - transformers| / max |transformers| per position
PPL_RTOL = 1e-4     # relative perplexity difference


class Failure(Exception):
    def __init__(self, code, msg):
        super().__init__(msg)
        self.code = code


def log(msg):
    print(f"check_smollm2: {msg}", file=sys.stderr, flush=True)


def load_fetch_module():
    spec = importlib.util.spec_from_file_location("fetch_smollm2",
                                                  os.path.join(_HERE, "fetch_smollm2.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_permutation(fetch):
    """llama.cpp (convert_hf_to_gguf.py, LlamaModel.permute) puts HF row
    h*d + i*(d/2) + j at GGUF row h*d + 2*j + i. Build that GGUF matrix element
    by element and check the converter's inverse gives the HF matrix back."""
    import numpy as np
    rng = np.random.default_rng(7)
    for n_head, d, inp in ((9, 64, 5), (3, 64, 3), (2, 4, 2)):
        w = rng.standard_normal((n_head * d, inp)).astype(np.float32)
        g = np.empty_like(w)
        for h in range(n_head):
            for i in range(2):
                for j in range(d // 2):
                    g[h * d + 2 * j + i] = w[h * d + i * (d // 2) + j]
        back = fetch.unpermute_rope_rows(g, n_head)
        if not np.array_equal(back, w):
            raise Failure(2, f"permutation: inverse of the llama.cpp RoPE permutation is wrong "
                             f"for {n_head} heads of {d}")
    return "inverse verified element by element (3 shapes)"


def check_config(model_dir, gguf_dir, gguf_name):
    from transformers import AutoConfig
    ref = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_name)
    with open(os.path.join(model_dir, "config.json")) as f:
        ours = json.load(f)
    keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "max_position_embeddings",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "model_type"]
    for k in keys:
        if ours.get(k) != getattr(ref, k, None):
            raise Failure(2, f"config: {model_dir}/config.json {k} = {ours.get(k)!r}, "
                             f"transformers reads {getattr(ref, k, None)!r} from the GGUF")
    rp = getattr(ref, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(ref, "rope_theta", None))
    for k, a, b in (("rope_theta", ours["rope_theta"], theta),
                    ("rms_norm_eps", ours["rms_norm_eps"], ref.rms_norm_eps)):
        if b is None or abs(a - b) > 1e-6 * abs(b):
            raise Failure(2, f"config: {k} {a} vs transformers {b}")
    return f"{len(keys) + 2} fields agree"


def load_reference_model(gguf_dir, gguf_name):
    import torch
    from transformers import AutoModelForCausalLM
    t0 = time.time()
    m = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name,
                                             dtype=torch.float32).eval()
    return m, time.time() - t0


def check_weights(model_dir, ref):
    import numpy as np
    from safetensors.numpy import load_file
    ours = load_file(os.path.join(model_dir, "model.safetensors"))
    sd = {k: v.detach().cpu().numpy() for k, v in ref.state_dict().items()}
    if ref.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    if set(ours) != set(sd):
        extra, miss = sorted(set(ours) - set(sd)), sorted(set(sd) - set(ours))
        raise Failure(2, f"weights: tensor names differ (only ours: {extra[:3]}, "
                         f"only transformers: {miss[:3]})")
    worst, worst_name, differ = 0.0, "", 0
    for k, v in ours.items():
        r = sd[k]
        if v.shape != r.shape:
            raise Failure(2, f"weights: {k}: shape {list(v.shape)} vs transformers {list(r.shape)}")
        if not np.array_equal(v.astype(np.float32), r):
            differ += 1
            d = float(np.abs(v.astype(np.float32) - r).max())
            if d > worst:
                worst, worst_name = d, k
    if differ and ours[next(iter(ours))].dtype == np.float32:
        raise Failure(2, f"weights: {differ} tensors differ from transformers' GGUF reading, "
                         f"worst {worst_name} (max abs diff {worst:g})")
    return (f"{len(ours)} tensors bit-identical to transformers' dequantization"
            if not differ else f"{differ} tensors differ by rounding to F16 (max {worst:g})")


def sample_texts(text_dirs):
    texts = [
        "Hello world, this is a test.\n\nNew paragraph.",
        "  leading spaces, trailing spaces  \n\t\ttabs\r\nCRLF   ",
        "def f(*args, **kwargs):\n    return {k: v for k, v in kwargs.items()}\n",
        "Unicode: naïve café — “quotes” … 日本語テキスト, emoji 🙂🚀, math ∑∫√, Ünïcödé",
        "Numbers 1234567890 3.14159 1e-05 0x7fff 2026-11-30",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
        "",
        " ",
        "\n\n\n",
    ]
    for d in text_dirs:
        files = sorted(glob.glob(os.path.join(d, "*.txt")))
        for f in files[:: max(1, len(files) // 6)][:6]:
            with open(f, encoding="utf-8") as fh:
                texts.append(fh.read()[:20000])
    return texts


def check_tokenizer(model_dir, gguf_path, text_dirs):
    import gguf
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    rd = gguf.GGUFReader(gguf_path)
    g_tokens = rd.fields["tokenizer.ggml.tokens"].contents()
    g_merges = rd.fields["tokenizer.ggml.merges"].contents()
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    vocab = dict(tj["model"]["vocab"])
    for a in tj.get("added_tokens", []):
        vocab[a["content"]] = a["id"]
    by_id = {i: t for t, i in vocab.items()}
    if len(by_id) != len(g_tokens):
        raise Failure(2, f"tokenizer: {len(by_id)} tokens in tokenizer.json, "
                         f"{len(g_tokens)} in the GGUF")
    for i, t in enumerate(g_tokens):
        if by_id.get(i) != t:
            raise Failure(2, f"tokenizer: token {i} is {by_id.get(i)!r} in tokenizer.json, "
                             f"{t!r} in the GGUF")
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    if merges != list(g_merges):
        k = next((i for i, (a, b) in enumerate(zip(merges, g_merges)) if a != b),
                 min(len(merges), len(g_merges)))
        raise Failure(2, f"tokenizer: merge {k} differs ({len(merges)} vs {len(g_merges)} merges)")

    fast = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ref = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                        gguf_file=os.path.basename(gguf_path))
    saved = AutoTokenizer.from_pretrained(model_dir)
    texts = sample_texts(text_dirs)
    ntok = 0
    for k, t in enumerate(texts):
        a = fast.encode(t, add_special_tokens=False).ids
        b = ref(t, add_special_tokens=False)["input_ids"]
        c = saved(t, add_special_tokens=False)["input_ids"]
        if a != b or c != b:
            raise Failure(2, f"tokenizer: text {k} ({t[:30]!r}...) encodes differently: "
                             f"tokenizer.json {len(a)} tokens, folder {len(c)}, GGUF {len(b)}")
        back = fast.decode(a, skip_special_tokens=False)
        if back != t:
            i = next((i for i, (x, y) in enumerate(zip(back, t)) if x != y), min(len(back), len(t)))
            raise Failure(2, f"tokenizer: text {k} does not round-trip (first difference at "
                             f"character {i}: {back[i:i + 20]!r} vs {t[i:i + 20]!r})")
        if ref.decode(b, skip_special_tokens=False) != t:
            raise Failure(2, f"tokenizer: text {k} does not round-trip through the GGUF tokenizer")
        ntok += len(a)
    return (f"vocabulary ({len(g_tokens)}) and merges ({len(g_merges)}) equal the GGUF's; "
            f"{len(texts)} texts, {ntok} tokens: same ids as the GGUF tokenizer, exact round trip")


def ref_logits(model, ids, batch=2):
    import numpy as np
    import torch
    out = []
    with torch.no_grad():
        for s in range(0, ids.shape[0], batch):
            x = torch.from_numpy(ids[s:s + batch].astype(np.int64))
            out.append(model(input_ids=x).logits.float().numpy())
    return np.concatenate(out, 0)


def nll_from_logits(lg, ids):
    """sum of -log p(token t | < t) over positions 1..T-1 (float64)."""
    import numpy as np
    S, T = ids.shape
    lg = lg.reshape(S, T, -1).astype(np.float64)
    x = lg[:, :-1]
    mx = x.max(-1, keepdims=True)
    lse = (mx[..., 0] + np.log(np.exp(x - mx).sum(-1)))
    tgt = np.take_along_axis(x, ids[:, 1:, None].astype(np.int64), -1)[..., 0]
    return float((lse - tgt).sum()), S * (T - 1)


def run_bakron(bakron, args):
    t0 = time.time()
    r = subprocess.run([bakron] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise Failure(3, f"{bakron} {' '.join(args)}: exit {r.returncode}: "
                         f"{r.stderr.strip().splitlines()[-1:] or ''}")
    return r.stdout, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(REPO_ROOT, "data", "smollm2", "model"))
    ap.add_argument("--gguf", default=os.path.join(REPO_ROOT, "data", "cache", "gguf",
                                                   "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--tokens", default=os.path.join(REPO_ROOT, "data", "smollm2",
                                                     "eval.safetensors"))
    ap.add_argument("--text", nargs="*", default=[os.path.join(REPO_ROOT, "data", "smollm2", "text", d)
                                                  for d in ("calib", "eval")],
                    help="folders of .txt documents for the tokenizer check")
    ap.add_argument("--bakron", default=os.path.join(REPO_ROOT, "build-smol", "bakron"))
    ap.add_argument("--logit-samples", type=int, default=4)
    ap.add_argument("--ppl-samples", type=int, default=0, help="0 = all sequences")
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=["tokenizer", "logits", "perplexity"], help="checks to skip")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", help="write the measured values here")
    a = ap.parse_args()

    for p in (a.model, a.gguf, a.tokens):
        if not os.path.exists(p):
            raise Failure(1, f"{p}: not found (run scripts/fetch_smollm2.py and "
                             f"scripts/prepare_text.py first)")
    import numpy as np
    import torch
    from safetensors.numpy import load_file
    torch.set_num_threads(a.threads)
    res = {"model": a.model, "gguf": a.gguf, "tokens": a.tokens,
           "torch": torch.__version__}
    import transformers
    res["transformers"] = transformers.__version__
    gdir, gname = os.path.dirname(a.gguf), os.path.basename(a.gguf)

    res["permutation"] = check_permutation(load_fetch_module())
    log(f"permutation ok: {res['permutation']}")
    res["config"] = check_config(a.model, gdir, gname)
    log(f"config ok: {res['config']}")
    ref, secs = load_reference_model(gdir, gname)
    res["transformers_gguf_load_seconds"] = round(secs, 1)
    res["weights"] = check_weights(a.model, ref)
    log(f"weights ok: {res['weights']}")
    if "tokenizer" not in a.skip:
        res["tokenizer"] = check_tokenizer(a.model, a.gguf, a.text)
        log(f"tokenizer ok: {res['tokenizer']}")

    ids_all = load_file(a.tokens)["input_ids"]
    if ids_all.ndim != 2:
        raise Failure(2, f"{a.tokens}: input_ids must be [sequences, seqlen]")
    if "logits" not in a.skip:
        S = min(a.logit_samples, ids_all.shape[0])
        ids = ids_all[:S]
        T = ids.shape[1]
        t0 = time.time()
        lr = ref_logits(ref, ids)
        t_ref = time.time() - t0
        lr = lr.reshape(S * T, -1)
        out = os.path.join(os.path.dirname(os.path.abspath(a.tokens)),
                           f"bakron-logits-{os.getpid()}.safetensors")
        try:
            _, t_bk = run_bakron(a.bakron, ["eval", a.model, "--tokens", a.tokens, "--samples",
                                            str(S), "--logits-out", out, "--json"])
            lb = load_file(out)["logits"]
        finally:
            if os.path.exists(out):
                os.unlink(out)
        if lb.shape != lr.shape:
            raise Failure(2, f"logits: bakron wrote {list(lb.shape)}, expected {list(lr.shape)}")
        diff = np.abs(lb.astype(np.float64) - lr)
        row_scale = np.abs(lr).max(1)
        rel_row = float((diff.max(1) / row_scale).max())
        rel_elem = float((diff / np.maximum(np.abs(lr), 1.0)).max())
        agree = float((lb.argmax(1) == lr.argmax(1)).mean())
        nr, cnt = nll_from_logits(lr, ids)
        nb, _ = nll_from_logits(lb, ids)
        res["logits"] = {
            "sequences": S, "seqlen": T, "positions": S * T,
            "max_abs_diff": float(diff.max()),
            "max_rel_diff_per_position": rel_row,
            "max_rel_diff_elementwise_floor1": rel_elem,
            "argmax_agreement": agree,
            "ppl_transformers": math.exp(nr / cnt), "ppl_bakron": math.exp(nb / cnt),
            "seconds_transformers": round(t_ref, 2), "seconds_bakron_eval": round(t_bk, 2),
        }
        log(f"logits: {json.dumps(res['logits'])}")
        if not rel_row <= LOGIT_RTOL:
            raise Failure(2, f"logits: max |bakron - transformers| / max|logit| per position = "
                             f"{rel_row:.3g} > {LOGIT_RTOL:g}")
    if "perplexity" not in a.skip:
        S = ids_all.shape[0] if a.ppl_samples <= 0 else min(a.ppl_samples, ids_all.shape[0])
        ids = ids_all[:S]
        t0 = time.time()
        nll, cnt = 0.0, 0
        with torch.no_grad():
            for s in range(0, S, 2):
                x = torch.from_numpy(ids[s:s + 2].astype(np.int64))
                lg = ref(input_ids=x).logits.float().numpy()
                n, c = nll_from_logits(lg.reshape(-1, lg.shape[-1]), ids[s:s + 2])
                nll += n
                cnt += c
        t_ref = time.time() - t0
        out, t_bk = run_bakron(a.bakron, ["eval", a.model, "--tokens", a.tokens, "--samples",
                                          str(S), "--json"])
        bj = json.loads(out)
        ppl_ref = math.exp(nll / cnt)
        res["perplexity"] = {
            "sequences": S, "seqlen": int(ids.shape[1]), "predicted_tokens": cnt,
            "ppl_transformers": ppl_ref, "ppl_bakron": bj["perplexity"],
            "bakron_tokens": bj["tokens"],
            "rel_diff": abs(bj["perplexity"] - ppl_ref) / ppl_ref,
            "seconds_transformers": round(t_ref, 1), "seconds_bakron_forward": bj["seconds"],
            "seconds_bakron_process": round(t_bk, 1),
        }
        log(f"perplexity: {json.dumps(res['perplexity'])}")
        if bj["tokens"] != cnt:
            raise Failure(2, f"perplexity: bakron counted {bj['tokens']} predicted tokens, "
                             f"expected {cnt}")
        if not res["perplexity"]["rel_diff"] <= PPL_RTOL:
            raise Failure(2, f"perplexity: bakron {bj['perplexity']:.6f} vs transformers "
                             f"{ppl_ref:.6f} (relative {res['perplexity']['rel_diff']:.3g} > "
                             f"{PPL_RTOL:g})")
    if a.json_out:
        with open(a.json_out + ".tmp", "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
        os.replace(a.json_out + ".tmp", a.json_out)
    print(json.dumps(res, indent=2))
    log("all checks passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print(f"check_smollm2: error: {e}", file=sys.stderr)
        sys.exit(e.code)
