#!/usr/bin/env python3
"""The course's GPT under PyTorch DistributedDataParallel, for chapter 02.

What it measures: the time of one full data-parallel training step (zero_grad,
forward, the mean cross-entropy over this rank's B/N*T positions, backward with
DDP's bucketed gradient all-reduce overlapped, AdamW on every replica) of exactly
the model in benchmarks/pytorch_gpt.py (our common/model/model.h written in PyTorch),
wrapped in torch.nn.parallel.DistributedDataParallel. Every rank is its own process
(the script starts them itself), all on the CPU, gloo backend, one thread per
process (OMP_NUM_THREADS=1 and torch.set_num_threads(1)).

The split is chapter 02's (02_ddp/main.cpp, course::data_parallel_slice): every rank
builds the same model from the same seed, draws the same global batch of --batch
sequences, and trains on its contiguous slice of --batch / N sequences (rank r: rows
r*B/N .. (r+1)*B/N - 1). DDP averages the gradients over the ranks, and the average
of the ranks' mean losses is the mean over the whole batch, so every replica takes
the step chapter 00 would take on the whole batch. DDP's buckets are PyTorch's
defaults (--bucket-mb 25, the first bucket 1 MB) unless --bucket-mb says otherwise
(chapter 02's default is 1 MB).

AdamW with the course's defaults (common/train/cli.h: lr 1e-3, no weight decay; betas
0.9/0.95 and eps 1e-8 as course::AdamW). A timed step is the window between two
barriers over all ranks: zero_grad, forward, backward, optimizer.step. tokens/s is
the global batch * seq / (median step seconds), over --steps steps after --warmup
untimed ones. The tokens are random bytes: only speed is measured here (the first
loss is about ln 256 = 5.55 all the same).

  python3 benchmarks/pytorch_ddp.py                        # tiny config, 2 ranks, global batch 8
  python3 benchmarks/pytorch_ddp.py --ranks 2 --batch 16 --bucket-mb 1
  python3 benchmarks/pytorch_ddp.py --steps 3 --warmup 1   # a smoke test

It prints one table row and a `RESULT {json}` line for scripts
(benchmarks/run_step_vs_pytorch.sh --ddp). A reference to measure against, not part
of the course: nothing builds or imports it.
"""
import argparse
import json
import math
import os
import sys
import time
import warnings

# torch's PyPI wheel does not pull numpy in, and without it every rank warns at import
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_gpt import (  # noqa: E402  (the same model as chapter 00's reference)
    GPT, add_multiprocess_args, check_model_args, finish_process_group, spawn_ranks, start_rank, step_time_fields,
    step_rates)


def worker(rank, a, port):
    start_rank(rank, a.ranks, port)
    N, V, T, L, C, B = a.ranks, a.vocab, a.seq, a.layers, a.d_model, a.batch
    rows = B // N
    first_row = rank * rows  # chapter 02's contiguous slice of the global batch

    # The same seed on every rank: identical replicas (DDP also broadcasts rank 0's
    # weights when it wraps the module, so they would be the same anyway).
    torch.manual_seed(a.seed)
    gpt = GPT(V, T, L, C, a.heads, sdpa=False)
    n_params = sum(t.numel() for t in gpt.parameters())
    # The causal masks (bool buffers, the same constant on every rank) stay out of DDP's
    # broadcasts: gloo in torch 1.13 (Debian's python3-torch) cannot broadcast bool tensors.
    DDP._set_params_and_buffers_to_ignore_for_model(gpt, [n for n, _ in gpt.named_buffers() if n.endswith("future")])
    model = DDP(gpt, bucket_cap_mb=a.bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay)

    gen = torch.Generator().manual_seed(a.seed + 1)  # the same global batches on every rank
    times, losses = [], []
    for step in range(a.warmup + a.steps):
        data = torch.randint(0, V, (B, T + 1), generator=gen)[first_row:first_row + rows]
        tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, targets)  # the mean over this rank's rows * T positions
        loss.backward()  # DDP all-reduces (averages) the gradient buckets as they become ready
        opt.step()
        dist.barrier()
        seconds = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(seconds)
        losses.append(loss.item())

    # the global batch's mean loss = the mean of the ranks' means (equal slices); outside the timed steps
    pair = torch.tensor([losses[0], losses[-1]], dtype=torch.float64)
    dist.all_reduce(pair)
    pair /= N
    if rank == 0:
        ms, tokens_per_s, gflops = step_rates(times, B, T, V, L, C)
        print(f"model: {L} layers, d_model {C}, {a.heads} heads, seq {T}, vocab {V}: {n_params} parameters "
              f"(a replica on every rank)")
        print(f"global batch {B}: {rows} sequences per rank | {N} ranks, gloo, cpu, 1 thread each | "
              f"DistributedDataParallel, buckets {a.bucket_mb:g} MB | AdamW lr {a.lr:g} wd {a.weight_decay:g} "
              f"| torch {torch.__version__}")
        print(f"first step loss {pair[0].item():.4f} (ln {V} = {math.log(V):.4f}), last {pair[1].item():.4f}; "
              f"median of {len(times)} timed steps after {a.warmup} warm-up (min {min(times) * 1e3:.1f} ms, "
              f"max {max(times) * 1e3:.1f} ms)")
        impl = "torch DDP"
        print(f"{'implementation':<24} {'ranks':>5} {'batch':>5} {'ms/step':>9} {'tokens/s':>10} {'GFLOP/s':>8}")
        print(f"{impl:<24} {N:>5} {B:>5} {ms:>9.2f} {tokens_per_s:>10.0f} {gflops:>8.2f}")
        result = dict(implementation="torch.nn.parallel.DistributedDataParallel", ranks=N, layers=L, d_model=C,
                      heads=a.heads, seq=T, batch=B, rows_per_rank=rows, vocab=V, parameters=n_params,
                      bucket_mb=a.bucket_mb, **step_time_fields(times, a.warmup),
                      tokens_per_s=round(tokens_per_s, 1), gflops=round(gflops, 3),
                      first_loss=round(pair[0].item(), 4), final_loss=round(pair[1].item(), 4),
                      backend="gloo", threads_per_rank=1, torch=torch.__version__)
        print("RESULT " + json.dumps(result), flush=True)
    finish_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="data-parallel ranks = processes")
    p.add_argument("--batch", type=int, default=8, help="global batch, in sequences, split over the ranks")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (PyTorch's default: 25)")
    add_multiprocess_args(p)
    a = p.parse_args()
    check_model_args(p, a)
    if a.ranks < 1 or a.batch % a.ranks != 0:
        p.error(f"--batch {a.batch} does not divide evenly over --ranks {a.ranks}")
    spawn_ranks(worker, a, a.ranks)


if __name__ == "__main__":
    main()
