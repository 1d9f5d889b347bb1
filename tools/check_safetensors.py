#!/usr/bin/env python3
"""Checks the course's safetensors export against a plain PyTorch GPT-2.

  python3 tools/check_safetensors.py model.safetensors logits.safetensors

Both files come from build/bin/export_safetensors (--out, --dump-logits). This loads
the model's tensors by their GPT-2 names (tools/README.md), runs a GPT-2-style forward
pass written here in a few lines of PyTorch (Conv1D weights: y = x @ W + b), and
compares its logits on the dumped tokens with the course's: the export is right if
every logit agrees within 1e-5 (fp32, only the order of additions differs).

Exit status: 0 they agree, 1 they do not, 77 PyTorch is not importable (CTest then
reports the test skipped). Tooling only: the course never runs or imports it.
"""
import json
import math
import struct
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError as error:
    print(f"SKIPPED: PyTorch is not importable by {sys.executable} ({error}); "
          "set COURSE_TORCH_PYTHON to a python3 that has torch")
    sys.exit(77)

TOLERANCE = 1e-5


def read_safetensors(path):
    """The tensors and metadata of a safetensors file, read by hand (no extra package)."""
    with open(path, "rb") as f:
        data = f.read()
    (header_bytes,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_bytes])
    metadata = header.pop("__metadata__", {})
    start = 8 + header_bytes
    dtypes = {"F32": torch.float32, "I32": torch.int32}
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        flat = torch.frombuffer(bytearray(data[start + begin:start + end]), dtype=dtypes[info["dtype"]])
        tensors[name] = flat.reshape(info["shape"])
    return tensors, metadata


def gpt2_logits(w, n_layer, n_head, tokens):
    """GPT-2's forward pass (pre-LayerNorm blocks, causal attention, GELU-tanh MLP), with
    an untied lm_head as the course has: (B, T) token ids -> (B, T, V) logits."""
    B, T = tokens.shape
    C = w["wte.weight"].shape[1]
    hs = C // n_head
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    x = w["wte.weight"][tokens] + w["wpe.weight"][:T]
    for i in range(n_layer):
        p = lambda name: w[f"h.{i}.{name}"]
        h = F.layer_norm(x, (C,), p("ln_1.weight"), p("ln_1.bias"), 1e-5)
        q, k, v = (h @ p("attn.c_attn.weight") + p("attn.c_attn.bias")).split(C, dim=2)
        q, k, v = (t.view(B, T, n_head, hs).transpose(1, 2) for t in (q, k, v))  # (B, NH, T, hs)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        y = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + y @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        h = F.layer_norm(x, (C,), p("ln_2.weight"), p("ln_2.bias"), 1e-5)
        h = F.gelu(h @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias"), approximate="tanh")
        x = x + h @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
    x = F.layer_norm(x, (C,), w["ln_f.weight"], w["ln_f.bias"], 1e-5)
    return x @ w["lm_head.weight"].T


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    weights, metadata = read_safetensors(sys.argv[1])
    batch, _ = read_safetensors(sys.argv[2])
    with torch.no_grad():
        ours = gpt2_logits(weights, int(metadata["n_layer"]), int(metadata["n_head"]), batch["tokens"].long())
    course = batch["logits"]
    worst = (ours - course).abs().max().item()
    print(f"torch {torch.__version__}: {len(weights)} GPT-2 tensors, logits {tuple(course.shape)}, "
          f"max |PyTorch - course| = {worst:.3g} (tolerance {TOLERANCE:g})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
