#!/usr/bin/env python3
"""Generate the malformed config.json corpus (tests/data/bad/config/) and the
malformed model folders (tests/data/bad/models/) used by tests/test_model.c and
tests/test_cli.sh.

Only the Python standard library is used: safetensors files are written by
hand (8-byte little-endian header length, JSON header padded with spaces,
data), independently of bakron's own writer. The output is deterministic;
rerun after editing and commit the result:

    python3 scripts/make_bad_models.py            # writes into tests/data/bad/
"""
import json
import os
import shutil
import struct
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "bad")

# ---------------------------------------------------------------- config.json

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def cfg(**kw):
    c = dict(BASE)
    for k, v in kw.items():
        if v is DROP:
            c.pop(k, None)
        else:
            c[k] = v
    return c


DROP = object()

# name -> JSON text (str) or dict. Expected status codes are typed into
# tests/test_model.c (bad_configs[]), not derived from this file.
CONFIGS = {
    "not_json.json": '{"model_type": "llama", "hidden_size": 64,, }\n',
    "empty.json": "",
    "truncated.json": json.dumps(BASE, indent=2)[:120],
    "top_level_array.json": "[1, 2, 3]\n",
    "trailing_garbage.json": json.dumps(BASE) + " }\n",
    "duplicate_key.json": '{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, '
                          '"intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 100, '
                          '"hidden_size": 128}\n',
    "missing_fields.json": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4},
    "missing_model_type.json": cfg(model_type=DROP),
    "null_hidden_size.json": cfg(hidden_size=None),
    "model_type_gpt2.json": cfg(model_type="gpt2"),
    "model_type_qwen2_moe.json": cfg(model_type="qwen2_moe"),
    "model_type_number.json": cfg(model_type=7),
    "hidden_size_fraction.json": cfg(hidden_size=64.5),
    "hidden_size_string.json": cfg(hidden_size="64"),
    "hidden_size_zero.json": cfg(hidden_size=0),
    "layers_negative.json": cfg(num_hidden_layers=-2),
    "vocab_huge.json": cfg(vocab_size=1e300),
    "intermediate_2pow60.json": cfg(intermediate_size=2 ** 60),
    "heads_not_dividing_hidden.json": cfg(hidden_size=100, num_attention_heads=8,
                                          num_key_value_heads=4),
    "kv_heads_not_dividing.json": cfg(num_attention_heads=8, num_key_value_heads=3,
                                      hidden_size=64),
    "kv_heads_more_than_heads.json": cfg(num_attention_heads=4, num_key_value_heads=8),
    "qwen2_default_kv_heads.json": cfg(model_type="qwen2", num_key_value_heads=DROP),
    "head_dim_odd.json": cfg(head_dim=15),
    "head_dim_zero.json": cfg(head_dim=0),
    "hidden_act_gelu.json": cfg(hidden_act="gelu"),
    "hidden_act_number.json": cfg(hidden_act=1),
    "tie_not_bool.json": cfg(tie_word_embeddings=1),
    "attention_bias_string.json": cfg(attention_bias="true"),
    "rms_eps_zero.json": cfg(rms_norm_eps=0),
    "rms_eps_string.json": cfg(rms_norm_eps="1e-5"),
    "rope_theta_string.json": cfg(rope_theta="10000"),
    "rope_theta_negative.json": cfg(rope_theta=-1.0),
    # float32 frequencies 1/theta^(2i/d) overflow (issue 14 point 12)
    "rope_theta_underflow.json": cfg(rope_theta=1e-50),
    "rope_scaling_yarn.json": cfg(rope_scaling={"type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 2048}),
    "rope_scaling_dynamic.json": cfg(rope_scaling={"type": "dynamic", "factor": 2.0}),
    "rope_parameters_longrope.json": cfg(rope_theta=DROP, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
        "long_factor": [1.0] * 8, "original_max_position_embeddings": 2048}),
    "rope_scaling_not_object.json": cfg(rope_scaling="linear"),
    "rope_type_number.json": cfg(rope_scaling={"rope_type": 3, "factor": 2.0}),
    "rope_linear_no_factor.json": cfg(rope_scaling={"type": "linear"}),
    "rope_linear_factor_negative.json": cfg(rope_scaling={"type": "linear", "factor": -2.0}),
    "rope_llama3_missing_keys.json": cfg(rope_theta=DROP, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}),
    "rope_llama3_freq_order.json": cfg(rope_theta=DROP, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 4.0,
        "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}),
    "rope_llama3_orig_fraction.json": cfg(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.5}),
    "rope_per_layer_type.json": cfg(rope_theta=DROP, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "partial_rotary.json": cfg(partial_rotary_factor=0.5),
    "dtype_int8.json": cfg(torch_dtype="int8"),
    "dtype_number.json": cfg(torch_dtype=DROP, dtype=16),
    "eos_string.json": cfg(eos_token_id="</s>"),
    "eos_list_negative.json": cfg(eos_token_id=[2, -1]),
    "bos_outside_vocab.json": cfg(bos_token_id=100),
    "eos_list_outside_vocab.json": cfg(eos_token_id=[2, 1000]),
    # a NUL in a key would cut it to "rope_theta" (issue 14 point 11)
    "key_with_nul.json": cfg(**{"rope_theta": DROP, "rope_theta\x00junk": 500000.0}),
    "raw_nul_in_string.json": json.dumps(cfg()).replace('"silu"', '"silu\x00gelu"'),
    "quantized_awq.json": cfg(quantization_config={"quant_method": "awq", "bits": 4,
                                                   "group_size": 128}),
    "quantization_config_no_method.json": cfg(quantization_config={"bits": 4}),
}

# --------------------------------------------------------------- safetensors

# A micro Llama: 1 layer, hidden 8, intermediate 16, 2 heads / 1 kv head,
# head_dim 4, vocab 16.
MICRO = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 1,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 16,
    "max_position_embeddings": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

DTYPE_SIZE = {"F32": 4, "I32": 4, "F8_E4M3": 1, "BF16": 2}


def micro_tensors(c, layers=None):
    """name -> (dtype, shape) of what the config implies."""
    h, i = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    t = {"model.embed_tokens.weight": ("F32", [c["vocab_size"], h])}
    for l in range(c["num_hidden_layers"] if layers is None else layers):
        p = "model.layers.%d." % l
        t[p + "input_layernorm.weight"] = ("F32", [h])
        t[p + "post_attention_layernorm.weight"] = ("F32", [h])
        t[p + "self_attn.q_proj.weight"] = ("F32", [q, h])
        t[p + "self_attn.k_proj.weight"] = ("F32", [kv, h])
        t[p + "self_attn.v_proj.weight"] = ("F32", [kv, h])
        t[p + "self_attn.o_proj.weight"] = ("F32", [h, q])
        if c["model_type"] == "qwen2":
            for m, n in (("q", q), ("k", kv), ("v", kv)):
                t[p + "self_attn.%s_proj.bias" % m] = ("F32", [n])
        if c["model_type"] == "qwen3":
            t[p + "self_attn.q_norm.weight"] = ("F32", [hd])
            t[p + "self_attn.k_norm.weight"] = ("F32", [hd])
        t[p + "mlp.gate_proj.weight"] = ("F32", [i, h])
        t[p + "mlp.up_proj.weight"] = ("F32", [i, h])
        t[p + "mlp.down_proj.weight"] = ("F32", [h, i])
    t["model.norm.weight"] = ("F32", [h])
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = ("F32", [c["vocab_size"], h])
    return t


def st_bytes(tensors):
    """A safetensors image; tensor data are a deterministic ramp."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        dt, shape = tensors[name]
        n = 1
        for d in shape:
            n *= d
        size = n * DTYPE_SIZE[dt]
        if dt == "F32":
            data = struct.pack("<%df" % n, *[((k % 13) - 6) / 8.0 for k in range(n)])
        else:
            data = bytes((k * 7) & 0x7F for k in range(size))
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + size]}
        blobs.append(data)
        off += size
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def write_model(name, config, tensors, shards=None, truncate=0):
    d = os.path.join(ROOT, "models", name)
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    if not shards:
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            f.write(st_bytes(tensors))
        return
    names = sorted(tensors)
    per = (len(names) + shards - 1) // shards
    wmap = {}
    for s in range(shards):
        fn = "model-%05d-of-%05d.safetensors" % (s + 1, shards)
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        img = st_bytes(part)
        if s == shards - 1 and truncate:
            img = img[:-truncate]
        with open(os.path.join(d, fn), "wb") as f:
            f.write(img)
        for n in part:
            wmap[n] = fn
    total = sum(DTYPE_SIZE[tensors[n][0]] * prod(tensors[n][1]) for n in names)
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=2)
        f.write("\n")


def prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def models():
    c = dict(MICRO)
    base = micro_tensors(c)

    t = dict(base)
    del t["model.layers.0.mlp.up_proj.weight"]
    write_model("missing_up_proj", c, t)

    t = {k: v for k, v in base.items() if ".self_attn." not in k}
    write_model("missing_attention", c, t)

    t = {k: v for k, v in base.items() if not k.startswith("model.layers.0.")}
    write_model("missing_layer", c, t)

    t = dict(base)
    del t["lm_head.weight"]
    write_model("missing_lm_head", c, t)

    t = dict(base)
    t["model.layers.0.self_attn.k_proj.weight"] = ("F32", [8, 8])
    write_model("shape_k_proj", c, t)

    t = dict(base)
    t["model.layers.0.mlp.down_proj.weight"] = ("F32", [16, 8])
    write_model("shape_down_transposed", c, t)

    t = dict(base)
    t["model.norm.weight"] = ("F32", [8, 1])
    write_model("shape_norm_2d", c, t)

    t = dict(base)
    t["model.embed_tokens.weight"] = ("F32", [17, 8])
    write_model("shape_vocab", c, t)

    t = dict(base)
    t["model.layers.0.input_layernorm.weight"] = ("I32", [8])
    write_model("dtype_int_norm", c, t)

    t = dict(base)
    t["model.layers.0.self_attn.q_proj.weight"] = ("F8_E4M3", [8, 8])
    write_model("dtype_f8_weight", c, t)

    t = dict(base)
    t["model.layers.0.mlp.extra_proj.weight"] = ("F32", [16, 8])
    write_model("unexpected_linear", c, t)

    t = dict(base)
    t["model.layers.0.self_attn.q_proj.bias"] = ("F32", [8])
    write_model("unexpected_bias", c, t)

    t = dict(micro_tensors(c, layers=2))
    write_model("unexpected_layer", c, t)

    ct = dict(c, tie_word_embeddings=True)
    write_model("tied_with_lm_head", ct, dict(base))

    t = dict(base)
    t["score.weight"] = ("F32", [2, 8])
    write_model("unexpected_head", c, t)

    cq = dict(c, model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    write_model("qwen2_without_biases", cq, dict(base))

    c3 = dict(c, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=4)
    write_model("qwen3_without_qk_norm", c3, dict(base))

    cu = dict(c, model_type="gpt2")
    write_model("config_gpt2", cu, dict(base))

    cr = dict(c, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 16})
    write_model("config_rope_yarn", cr, dict(base))

    write_model("truncated_shard", c, dict(base), shards=2, truncate=16)


def main():
    for sub in ("config", "models"):
        p = os.path.join(ROOT, sub)
        if os.path.isdir(p):
            shutil.rmtree(p)
        os.makedirs(p)
    for name, text in CONFIGS.items():
        if not isinstance(text, str):
            text = json.dumps(text, indent=2) + "\n"
        with open(os.path.join(ROOT, "config", name), "w") as f:
            f.write(text)
    models()
    print("wrote %d configs and %d model folders under %s" % (
        len(CONFIGS), len(os.listdir(os.path.join(ROOT, "models"))), os.path.normpath(ROOT)),
        file=sys.stderr)


if __name__ == "__main__":
    main()
