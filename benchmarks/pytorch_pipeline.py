#!/usr/bin/env python3
"""The course's GPT in a PyTorch pipeline (torch.distributed.pipelining), for chapter 05.

What it measures: the time of one full pipeline-parallel training step (zero_grad,
one schedule step over --micro-batches micro-batches, AdamW on every stage), of
exactly the model in benchmarks/pytorch_gpt.py (our common/model/model.h written in
PyTorch), cut into --pp stages the way chapter 04/05 cut it
(04_naive_model_parallel/model_split.cpp):

  stage 0      the embedding (wte + wpe) and the first group of blocks
  stage i      the next group of blocks
  stage N-1    the last group of blocks, the final LayerNorm, the LM head
               (the mean cross-entropy is the schedule's loss_fn on this stage)

The L blocks are split as evenly as possible; the first L % N stages get one block
more. Every stage is a torch.distributed.pipelining.PipelineStage in its own
process (the script starts them itself), all on the CPU, gloo backend, one thread
per process (OMP_NUM_THREADS=1 and torch.set_num_threads(1)), driven by
Schedule1F1B (--schedule 1f1b) or ScheduleGPipe (--schedule gpipe). The schedule
scales each micro-batch's gradient by 1/M (scale_grads), so the gradient is that of
the mean loss over the whole batch, as in the course.

A timed step is the window between two barriers over all ranks (as chapter 05's
executor measures it): zero_grad, schedule.step, optimizer.step. tokens/s is
batch * seq / (median step seconds). The tokens are random bytes: only speed is
measured here (the first loss is about ln 256 = 5.55 all the same).

  python3 benchmarks/pytorch_pipeline.py                       # tiny config, 2 stages, 1F1B, 8 micro-batches
  python3 benchmarks/pytorch_pipeline.py --schedule gpipe
  python3 benchmarks/pytorch_pipeline.py --steps 3 --warmup 1  # a smoke test

It prints one table row and a `RESULT {json}` line for scripts
(benchmarks/run_pipeline.sh). A reference to measure against, not part of the
course: nothing builds or imports it.
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
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_gpt import (  # noqa: E402  (the same model as chapter 00's reference)
    GPT, add_multiprocess_args, check_model_args, finish_process_group, spawn_ranks, start_rank, step_time_fields,
    step_rates)


def split_blocks(L, parts):
    """[(first_block, end_block)) per stage: as equal as possible, the first L % parts get one more
    (course::split_stages in 04_naive_model_parallel/model_split.cpp)."""
    if not 1 <= parts <= L:
        raise ValueError(f"cannot cut {L} blocks into {parts} pipeline stages: every stage needs a block")
    ranges, first = [], 0
    for part in range(parts):
        n = L // parts + (1 if part < L % parts else 0)
        ranges.append((first, first + n))
        first += n
    return ranges


class Stage(nn.Module):
    """One pipeline stage of pytorch_gpt.GPT: [embedding +] blocks [+ lnf + lm_head]."""

    def __init__(self, gpt, first_block, end_block, is_first, is_last):
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(gpt.blocks[first_block:end_block])
        if is_last:
            self.lnf, self.lm_head = gpt.lnf, gpt.lm_head

    def forward(self, x):  # first stage: (B, T) byte tokens; later stages: (B, T, C) activations
        if self.is_first:
            T = x.shape[1]
            x = self.wte(x) + self.wpe(torch.arange(T, device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            x = self.lm_head(self.lnf(x))  # (B, T, V) logits; the loss is the schedule's loss_fn
        return x


def mean_cross_entropy(logits, targets):
    """One micro-batch's mean cross-entropy over its B*T positions (what our last stage computes)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def worker(rank, a, port):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    start_rank(rank, a.pp, port)
    N, V, T, L, C, B, M = a.pp, a.vocab, a.seq, a.layers, a.d_model, a.batch, a.micro_batches
    dev = torch.device("cpu")

    # Every rank builds the whole model from the same seed, so the stages together are
    # exactly pytorch_gpt.GPT's initial weights, and keeps only its own part.
    torch.manual_seed(a.seed)
    gpt = GPT(V, T, L, C, a.heads, sdpa=False)
    total_params = sum(t.numel() for t in gpt.parameters())
    first, end = split_blocks(L, N)[rank]
    module = Stage(gpt, first, end, rank == 0, rank == N - 1)
    del gpt
    # Shapes given up front (one micro-batch's input and output), so the stage skips its
    # metadata exchange (which pickles through numpy, not installed with torch) and the
    # first step is a normal one. requires_grad marks what gradients flow back through:
    # without it on the activations, the stage sends no input gradient back.
    mb = B // M
    example_in = torch.empty(mb, T, dtype=torch.long) if rank == 0 else torch.empty(mb, T, C, requires_grad=True)
    example_out = torch.empty(mb, T, V if rank == N - 1 else C, requires_grad=True)
    stage = PipelineStage(module, rank, N, dev, input_args=(example_in,), output_args=(example_out,))
    schedule_class = Schedule1F1B if a.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_class(stage, n_microbatches=M, loss_fn=mean_cross_entropy)
    opt = torch.optim.AdamW(module.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay)
    stage_params = sum(t.numel() for t in module.parameters())

    gen = torch.Generator().manual_seed(a.seed + 1)  # the same batches on every rank
    times, first_loss, last_loss = [], None, None
    for step in range(a.warmup + a.steps):
        data = torch.randint(0, V, (B, T + 1), generator=gen)
        tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        losses = []
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and rank == N - 1:
            schedule.step(tokens, target=targets, losses=losses)
        elif rank == 0:
            schedule.step(tokens)
        elif rank == N - 1:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        opt.step()
        dist.barrier()
        seconds = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(seconds)
        if rank == N - 1:
            last_loss = torch.stack([l.detach().float() for l in losses]).mean().item()
            if first_loss is None:
                first_loss = last_loss

    # the last stage has the losses, rank 0 prints: one broadcast of [first, last]
    loss_pair = torch.tensor([first_loss or 0.0, last_loss or 0.0], dtype=torch.float64)
    dist.broadcast(loss_pair, src=N - 1)
    counts = torch.tensor([stage_params], dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(N)]
    dist.all_gather(gathered, counts)
    if rank == 0:
        stage_counts = [int(t.item()) for t in gathered]
        assert sum(stage_counts) == total_params, (stage_counts, total_params)
        ms, tokens_per_s, gflops = step_rates(times, B, T, V, L, C)
        ranges = split_blocks(L, N)
        cut = " | ".join(("embedding + " if s == 0 else "") + f"blocks {f}-{e - 1}" + (" + head" if s == N - 1 else "")
                         for s, (f, e) in enumerate(ranges))
        print(f"model: {L} layers, d_model {C}, {a.heads} heads, seq {T}, vocab {V}: {total_params} parameters "
              f"| stages: {cut} ({'/'.join(map(str, stage_counts))} parameters)")
        print(f"batch {B} in {M} micro-batches of {B // M} | {N} ranks, gloo, cpu, 1 thread each | "
              f"torch.distributed.pipelining {schedule_class.__name__} | AdamW lr {a.lr:g} wd {a.weight_decay:g} "
              f"| torch {torch.__version__}")
        print(f"first step loss {loss_pair[0].item():.4f} (ln {V} = {math.log(V):.4f}), last {loss_pair[1].item():.4f}; "
              f"median of {len(times)} timed steps after {a.warmup} warm-up (min {min(times) * 1e3:.1f} ms, "
              f"max {max(times) * 1e3:.1f} ms)")
        impl = "torch.pipelining " + a.schedule
        print(f"{'implementation':<24} {'ranks':>5} {'M':>3} {'batch':>5} {'ms/step':>9} {'tokens/s':>10} {'GFLOP/s':>8}")
        print(f"{impl:<24} {N:>5} {M:>3} {B:>5} {ms:>9.2f} {tokens_per_s:>10.0f} {gflops:>8.2f}")
        result = dict(implementation="torch.distributed.pipelining", schedule=a.schedule,
                      schedule_class=schedule_class.__name__, pp=N, micro_batches=M, layers=L, d_model=C,
                      heads=a.heads, seq=T, batch=B, parameters=total_params, stage_parameters=stage_counts,
                      **step_time_fields(times, a.warmup),
                      tokens_per_s=round(tokens_per_s, 1), gflops=round(gflops, 3),
                      first_loss=round(loss_pair[0].item(), 4), final_loss=round(loss_pair[1].item(), 4),
                      backend="gloo", threads_per_rank=1, torch=torch.__version__)
        print("RESULT " + json.dumps(result), flush=True)
    finish_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline stages = processes")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first one infers shapes)")
    add_multiprocess_args(p)
    a = p.parse_args()
    check_model_args(p, a)
    if a.batch % a.micro_batches != 0:
        p.error(f"--batch {a.batch} does not divide into --micro-batches {a.micro_batches}")
    if not 1 <= a.pp <= a.layers:
        p.error(f"--pp {a.pp} needs 1 to --layers ({a.layers}) stages: every stage needs a block")
    spawn_ranks(worker, a, a.pp)


if __name__ == "__main__":
    main()
