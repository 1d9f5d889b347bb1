#!/usr/bin/env python3
"""PyTorch eager reference of the course's GPT, for comparing training speed.

What it measures: the time of one full training step (zero_grad, forward, backward,
AdamW update) of exactly our model (common/model/model.h, common/tensor/ops_cpu.cpp), written
in plain PyTorch: byte vocabulary, learned token + position embeddings, L pre-LayerNorm
blocks (fused qkv, causal attention with explicit T x T scores, proj, GELU-tanh MLP
C -> 4C -> C), a final LayerNorm, an untied bias-free LM head and the mean
cross-entropy over all B*T positions. The attention materialises the scores like ours
does, so the FLOPs and the activation memory are comparable; --sdpa switches to
F.scaled_dot_product_attention (flash/memory-efficient kernels) as an extra point.

TFLOP/s use our formula (course::training_flops_per_token in common/model/model.cpp):
6 x (weights used in GEMMs) + 12 L T C, so they line up with chapter 00's numbers.
MFU is that rate over --peak-tflops (default 989.4: H100 SXM, bf16 dense), whatever
--dtype is.

  --dtype fp32  fp32 matmuls (TF32 off)                  ours: --dtype fp32
  --dtype tf32  fp32 tensors, TF32 tensor-core matmuls    ours: --tf32
  --dtype bf16  autocast to bf16, fp32 master weights     ours: --dtype bf16

Run it (GPT-2 small shape, byte vocabulary, on a GPU with PyTorch installed):

  python3 benchmarks/pytorch_gpt.py --dtype bf16
  python3 benchmarks/pytorch_gpt.py --dtype bf16 --sdpa --fused
  python3 benchmarks/pytorch_gpt.py --device cpu --layers 2 --d-model 64 --heads 4 \
      --seq 64 --batch 2 --steps 3 --warmup 1          # a smoke test on a laptop
  OMP_NUM_THREADS=1 python3 benchmarks/pytorch_gpt.py --device cpu --dtype fp32 --threads 1 \
      --layers 4 --d-model 128 --heads 4 --seq 128 --batch 8   # chapter 00's shape on one core

It prints one table row and a `RESULT {json}` line for scripts. This file is a
reference to measure against, not part of the course: nothing builds or imports it.
"""
import argparse
import json
import math
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, C, n_head, T, sdpa):
        super().__init__()
        self.n_head, self.sdpa = n_head, sdpa
        self.ln1 = nn.LayerNorm(C, eps=1e-5)
        self.qkv = nn.Linear(C, 3 * C)  # q, k, v side by side; head h = columns h*hs..(h+1)*hs
        self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C, eps=1e-5)
        self.fc = nn.Linear(C, 4 * C)
        self.fcproj = nn.Linear(4 * C, C)
        # True above the diagonal: the future positions each query must not see
        self.register_buffer("future", torch.triu(torch.ones(T, T, dtype=torch.bool), 1), persistent=False)

    def attention(self, x):
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))  # (B, NH, T, hs)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, NH, T, T)
            att = F.softmax(scores.masked_fill(self.future[:T, :T], float("-inf")), dim=-1)
            y = att @ v  # (B, NH, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.proj(y)

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, V, T, L, C, n_head, sdpa):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block(C, n_head, T, sdpa) for _ in range(L))
        self.lnf = nn.LayerNorm(C, eps=1e-5)
        self.lm_head = nn.Linear(C, V, bias=False)  # untied from wte
        for m in self.modules():  # weights N(0, 0.02), biases 0 (LayerNorm: weight 1, bias 0)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, tokens, targets):  # (B, T), (B, T) -> mean cross-entropy
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(T, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.lnf(x))  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1))


def training_flops_per_token(V, T, L, C):
    """The same formula as course::training_flops_per_token (common/model/model.cpp)."""
    gemm_weights = L * 12.0 * C * C + V * C  # qkv + proj + fc + fcproj per block, lm head
    return 6.0 * gemm_weights + 12.0 * L * T * C


def add_multiprocess_args(p):
    """The flags the multi-process references (pytorch_pipeline.py, pytorch_tp.py) share:
    the model's shape, the course's optimizer defaults (common/train/cli.h: lr 1e-3, no weight
    decay; betas 0.9/0.95 and eps 1e-8 as course::AdamW), timing, seed and port."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--port", type=int, default=0, help="MASTER_PORT (0: a free one)")


def finish_process_group():
    """Ends a worker of the multi-process references: barrier, destroy the group, then
    leave without the interpreter's finalisation. About one run in ten (torch 2.15,
    gloo), a gloo worker thread still freeing the last barrier's work wants the GIL
    while the interpreter shuts down, and the process dies of "terminate called without
    an active exception" (SIGABRT) after all its work is done (pytorch/pytorch#179291
    describes the mechanism)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rank(rank, world, port):
    """Joins this process, rank `rank` of `world`, to the gloo group of a multi-process
    reference (127.0.0.1:port), with one thread for its own work."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def check_model_args(p, a):
    """The checks of the flags every reference shares: the model's shape and the timing."""
    if a.d_model % a.heads != 0:
        p.error(f"--heads {a.heads} does not divide --d-model {a.d_model}")
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")


def spawn_ranks(worker, a, ranks):
    """Starts worker(rank, a, port) in `ranks` processes, one thread each."""
    import torch.multiprocessing as mp
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks before torch starts there
    mp.spawn(worker, args=(a, a.port or free_port()), nprocs=ranks, join=True)


def step_rates(times, B, T, V, L, C):
    """The median step in ms, tokens/s and model GFLOP/s (training_flops_per_token) of
    steps of B sequences of T tokens."""
    ms = statistics.median(times) * 1e3
    tokens_per_s = B * T / (ms / 1e3)
    return ms, tokens_per_s, tokens_per_s * training_flops_per_token(V, T, L, C) / 1e9


def reference_step(reference, opt, tokens, targets):
    """One step of the unsplit model that --check trains next to a parallel one; its loss."""
    opt.zero_grad(set_to_none=True)
    loss = reference(tokens, targets)
    loss.backward()
    opt.step()
    return loss.item()


def print_loss_check(what, losses, ref_losses):
    """Prints both runs' losses step by step; returns the largest difference."""
    max_diff = max(abs(x - y) for x, y in zip(losses, ref_losses))
    print(f"check: losses, {what} vs the unsplit pytorch_gpt.GPT: "
          + ", ".join(f"{x:.6f}/{y:.6f}" for x, y in zip(losses, ref_losses))
          + f"; largest difference {max_diff:.2e}")
    return max_diff


def step_time_fields(times, warmup):
    """The RESULT line's timing fields: the median step and the spread, in ms."""
    return dict(steps=len(times), warmup=warmup, ms_per_step=round(statistics.median(times) * 1e3, 3),
                min_ms=round(min(times) * 1e3, 3), max_ms=round(max(times) * 1e3, 3))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=["fp32", "tf32", "bf16"], default="bf16")
    p.add_argument("--sdpa", action="store_true", help="F.scaled_dot_product_attention instead of explicit scores")
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True) instead of the default (foreach on GPU)")
    p.add_argument("--peak-tflops", type=float, default=989.4, help="for MFU (H100 SXM bf16 dense: 989.4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads(N) for the CPU (0: PyTorch's default)")
    a = p.parse_args()
    check_model_args(p, a)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but PyTorch sees no GPU (hint: --device cpu)")

    if a.threads > 0:
        torch.set_num_threads(a.threads)
    tf32 = a.dtype == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    V, T, L, C, B = a.vocab, a.seq, a.layers, a.d_model, a.batch

    model = GPT(V, T, L, C, a.heads, a.sdpa).to(dev)  # fp32 parameters in every mode
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                            **({"fused": True} if a.fused else {}))  # no fused= at all: torch < 2.0 has none
    n_params = sum(t.numel() for t in model.parameters())
    print(f"model: {L} layers, d_model {C}, {a.heads} heads, seq {T}, vocab {V}: {n_params} parameters | "
          f"batch {B} | {a.device} {a.dtype} | attention {'sdpa' if a.sdpa else 'explicit'} | "
          f"AdamW {'fused' if a.fused else 'default'} | {torch.get_num_threads()} CPU thread(s) | torch {torch.__version__}")

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, first_loss, loss = [], None, None
    for step in range(a.warmup + a.steps):
        data = torch.randint(0, V, (B, T + 1), device=dev)  # random bytes; targets = the next byte
        tokens, targets = data[:, :-1], data[:, 1:]
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            loss = model(tokens, targets)
        loss.backward()
        opt.step()
        sync()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
        if first_loss is None:
            first_loss = loss.item()

    ms = statistics.median(times) * 1e3
    tokens_per_s = B * T / (ms / 1e3)
    tflops = tokens_per_s * training_flops_per_token(V, T, L, C) / 1e12
    mfu = 100.0 * tflops / a.peak_tflops
    peak_gb = torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else None  # none on the CPU
    impl = "pytorch-eager" + ("+sdpa" if a.sdpa else "") + ("+fused" if a.fused else "")
    print(f"first step loss {first_loss:.4f} (ln {V} = {math.log(V):.4f}), last {loss.item():.4f}; "
          f"median of {len(times)} timed steps after {a.warmup} warm-up")
    print(f"{'implementation':<26} {'dtype':>5} {'batch':>5} {'ms/step':>9} {'tokens/s':>10} "
          f"{'TFLOP/s':>8} {'MFU %':>6} {'peak GB':>8}")
    print(f"{impl:<26} {a.dtype:>5} {B:>5} {ms:>9.2f} {tokens_per_s:>10.0f} {tflops:>8.2f} {mfu:>6.1f} "
          f"{'n/a' if peak_gb is None else f'{peak_gb:.2f}':>8}")
    result = dict(implementation=impl, device=a.device, dtype=a.dtype, layers=L, d_model=C, heads=a.heads, seq=T,
                  batch=B, parameters=n_params, steps=len(times), ms_per_step=round(ms, 3),
                  tokens_per_s=round(tokens_per_s, 1), tflops=round(tflops, 3), mfu_percent=round(mfu, 2),
                  peak_gpu_gb=None if peak_gb is None else round(peak_gb, 3),
                  first_loss=round(first_loss, 4), threads=torch.get_num_threads(), torch=torch.__version__)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
