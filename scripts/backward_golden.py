#!/usr/bin/env python3
"""PyTorch autograd goldens for bakron's backward pass (src/backward.c).

For each model, runs Hugging Face transformers in float64 (RMSNorm patched to
stay in float64: transformers computes it in float32; eager attention) on a
few calibration sequences with fixed labels, takes the loss

    L = sum over labelled positions of -log softmax(logits)[label]

and records, for every decoder layer i and linear module M, the module's input
and the gradient of L with respect to the module's output (autograd).

Writes tests/data/backward/<model>.safetensors with
  input_ids [S, T] I32, labels [S, T] I32 (-1: no label), loss [1] F64,
  layers.{i}.{module}.grad  [S, T, out] F32   (e.g. layers.0.self_attn.q_proj.grad)
  layers.{i}.{module}.input [S, T, in]  F32   (q_proj, o_proj, gate_proj, down_proj only)

The labels are sampled from the model's own predictive distribution
(torch.multinomial, fixed generator seed); the last position of the first
sequence is left unlabelled (-1) to cover the masking.

Nothing here uses bakron. Run from the repository root:
    pip install torch transformers safetensors numpy
    python3 scripts/backward_golden.py
"""
import os
import sys

# scripts/tokenize.py would shadow the standard library's tokenize module
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "backward")

# (name, model folder, golden file with input_ids, sequences, tokens)
MODELS = [
    ("tiny-llama3", "tests/data/models/tiny-llama3", "tests/data/models/tiny-llama3/golden.safetensors", 2, 8),
    ("tiny-qwen2", "tests/data/models/tiny-qwen2", "tests/data/models/tiny-qwen2/golden.safetensors", 2, 8),
    ("tiny-qwen3", "tests/data/models/tiny-qwen3", "tests/data/models/tiny-qwen3/golden.safetensors", 2, 8),
    ("kerneldocs-1.6m", "examples/kerneldocs-1.6m",
     "tests/data/golden/kerneldocs-1.6m/golden.safetensors", 1, 16),
]
MODULES = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
KEEP_INPUT = {"self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"}


def rms_forward(self, x):
    var = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


def patch_norms():
    import transformers.models.llama.modeling_llama as ml
    import transformers.models.qwen2.modeling_qwen2 as mq2
    import transformers.models.qwen3.modeling_qwen3 as mq3
    ml.LlamaRMSNorm.forward = rms_forward
    mq2.Qwen2RMSNorm.forward = rms_forward
    mq3.Qwen3RMSNorm.forward = rms_forward


def one(name, folder, golden, S, T):
    from transformers import AutoModelForCausalLM
    path = os.path.join(ROOT, folder)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                 attn_implementation="eager")
    model.eval()
    ids = load_file(os.path.join(ROOT, golden))["input_ids"][:S, :T].astype(np.int64)
    x = torch.from_numpy(ids)

    outs, ins = {}, {}

    def hook(key):
        def f(mod, args, out):
            out.retain_grad()
            outs[key] = out
            ins[key] = args[0].detach()
        return f

    handles = []
    n_layers = model.config.num_hidden_layers
    for i in range(n_layers):
        layer = model.model.layers[i]
        for m in MODULES:
            part, proj = m.split(".")
            lin = getattr(getattr(layer, part), proj)
            handles.append(lin.register_forward_hook(hook(f"layers.{i}.{m}")))

    logits = model(input_ids=x).logits  # [S, T, V]
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        p = torch.softmax(logits.reshape(S * T, -1), dim=-1)
        labels = torch.multinomial(p, 1, generator=g).reshape(S, T)
    labels[0, T - 1] = -1
    loss = torch.nn.functional.cross_entropy(logits.reshape(S * T, -1), labels.reshape(-1),
                                             ignore_index=-1, reduction="sum")
    loss.backward()
    for h in handles:
        h.remove()

    res = {
        "input_ids": ids.astype(np.int32),
        "labels": labels.numpy().astype(np.int32),
        "loss": np.array([loss.item()], dtype=np.float64),
    }
    for k, out in outs.items():
        res[k + ".grad"] = out.grad.numpy().astype(np.float32)
        mod = k.split(".", 2)[2]
        if mod in KEEP_INPUT:
            res[k + ".input"] = ins[k].numpy().astype(np.float32)
    os.makedirs(OUT, exist_ok=True)
    dst = os.path.join(OUT, name + ".safetensors")
    meta = {"made_by": "scripts/backward_golden.py",
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "precision": "float64 (RMSNorm patched to float64, eager attention)"}
    save_file(res, dst, metadata=meta)
    print(f"{dst}: loss {loss.item():.10g}, {len(res)} tensors, {os.path.getsize(dst)} bytes")


def main():
    patch_norms()
    only = set(sys.argv[1:])
    for m in MODELS:
        if not only or m[0] in only:
            one(*m)


if __name__ == "__main__":
    main()
