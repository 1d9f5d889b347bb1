#!/usr/bin/env python3
"""The course's GPT under PyTorch tensor parallelism (DTensor, parallelize_module), for chapter 06.

What it measures: the time of one full tensor-parallel training step (zero_grad,
forward, the mean cross-entropy over all B*T positions, backward, AdamW on every
rank) of exactly the model in benchmarks/pytorch_gpt.py (our common/model/model.h written
in PyTorch), its weights split over --tp ranks with
torch.distributed.tensor.parallel.parallelize_module on a 1-D DeviceMesh("cpu", ...).
Every rank is its own process (the script starts them itself), all on the CPU, gloo
backend, one thread per process (OMP_NUM_THREADS=1 and torch.set_num_threads(1)).
Every rank sees the whole batch: in tensor parallelism the global batch is the batch.

The plan, per block (Megatron's split, as in the PyTorch TP tutorial and torchtitan):

  qkv     ColwiseParallel     output columns = this rank's heads; the attention runs
                              on plain local tensors (use_local_output=True)
  proj    RowwiseParallel     input rows = this rank's heads; all-reduce of the output
  fc      ColwiseParallel     4C / tp hidden units per rank, GELU local
  fcproj  RowwiseParallel     all-reduce of the output
  ln1, ln2, lnf               replicated plain modules (every rank computes them whole)

The fused qkv. pytorch_gpt's qkv weight is (3C, C) with the rows [q | k | v], and
ColwiseParallel cuts rows into tp contiguous blocks, so a plain shard would give rank 0
all of q and part of k. Before parallelizing, the qkv weight's rows (and its bias) are
permuted to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], where q_r, k_r, v_r are the C/tp rows of
rank r's heads (heads r*H/tp .. (r+1)*H/tp - 1, head h = rows h*hs..(h+1)*hs of each
part). Rank r's contiguous shard is then exactly [q_r | k_r | v_r], and the TP block's
attention (TPBlock below: the same math as pytorch_gpt.Block.attention) splits its
local (B, T, 3C/tp) output into three C/tp parts and views them as H/tp heads. Its
(B, T, C/tp) output holds rank r's heads side by side, which are exactly the input
columns r*C/tp..(r+1)*C/tp that RowwiseParallel gives proj on rank r. At --tp 1 the
permutation is the identity; for every tp the model is the same function of the same
weights (--check trains the unsplit pytorch_gpt.GPT next to it and prints the losses'
largest difference).

Embeddings and head (vocabulary 256: a small share of the FLOPs):

  wte     RowwiseParallel(input_layouts=Replicate())   rows = this rank's V/tp tokens;
                                                       all-reduce of the (B, T, C) output
  wpe     replicated plain module (as chapter 06: every rank adds all T positions)
  lm_head ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
          and loss_parallel(): the logits stay sharded by vocabulary and the
          cross-entropy is computed on the vocabulary shards (three small all-reduces:
          the row max, the sum of exponentials, the target's logit), never gathering
          the (B, T, V) logits

so, like chapter 06, wte and the head are sharded by vocabulary.

--sp: sequence parallelism the way the TP tutorial and torchtitan's llama plan do it:
ln1, ln2 and lnf SequenceParallel() (replicated weights, inputs and outputs sharded on
the sequence dimension), qkv and fc ColwiseParallel(input_layouts=Shard(1)) (all-gather
of the sequence shards into the whole (B, T, C) input), proj and fcproj
RowwiseParallel(output_layouts=Shard(1)) (reduce-scatter instead of all-reduce), wte
RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)) (a reduce-scatter),
wpe RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)) (its rows
sharded by position, and a reduce-scatter of its (T, C) output gives each rank its
T/tp positions: DTensor's way to the rows chapter 06 slices from its replicated wpe), lm_head
ColwiseParallel(input_layouts=Shard(1), ...). The residual stream is then each rank's
(B, T/tp, C) sequence shard: the residual adds run on those local shards (torchtitan's
way: the Rowwise outputs are local tensors, SequenceParallel turns them into Shard(1)
DTensors again), the LayerNorms on (B, T/tp, C). The replicated LayerNorm weights'
gradients come out of backward as Partial(sum) DTensors (each rank's sum over its own
positions); the step all-reduces each of them once, right after backward
(reduce_partial_grads: left Partial, DTensor would all-reduce one again at each of the
three AdamW operations that read it). Needs --seq divisible by --tp.
Everything here works on gloo and the CPU (gloo has all-reduce, all-gather and
reduce-scatter) with torch 2.15.

A timed step is the window between two barriers over all ranks (as pytorch_pipeline.py
measures it): zero_grad, forward, loss, backward, AdamW (lr 1e-3,
betas 0.9/0.95, eps 1e-8, no weight decay). tokens/s is batch * seq / (median step
seconds). The tokens are random bytes: only speed is measured here (the first loss
is about ln 256 = 5.55 all the same).

  python3 benchmarks/pytorch_tp.py                          # tiny config, 2 ranks
  python3 benchmarks/pytorch_tp.py --sp                     # with sequence parallelism
  python3 benchmarks/pytorch_tp.py --steps 3 --warmup 0 --check   # a smoke test: losses vs the unsplit model

It prints one table row and a `RESULT {json}` line for scripts
(benchmarks/run_tensor_parallel.sh). A reference to measure against, not part of the
course: nothing builds or imports it.
"""
import argparse
import copy
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
    print_loss_check, reference_step, step_rates)


def permute_qkv_for_tp(qkv, C, tp):
    """Reorder the fused qkv rows [q | k | v] to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (in place), so
    ColwiseParallel's contiguous row block r is rank r's heads' q, k and v (see the docstring)."""
    Cr = C // tp
    order = torch.cat([torch.arange(part * C + r * Cr, part * C + (r + 1) * Cr)
                       for r in range(tp) for part in range(3)])
    with torch.no_grad():
        qkv.weight.copy_(qkv.weight[order])
        qkv.bias.copy_(qkv.bias[order])


class TPBlock(nn.Module):
    """pytorch_gpt.Block with its attention on this rank's H/tp heads (plain local tensors)."""

    def __init__(self, block, tp):
        super().__init__()
        self.local_heads = block.n_head // tp
        self.ln1, self.qkv, self.proj = block.ln1, block.qkv, block.proj
        self.ln2, self.fc, self.fcproj = block.ln2, block.fc, block.fcproj
        self.register_buffer("future", block.future, persistent=False)

    def attention(self, x):
        qkv = self.qkv(x)  # (B, T, 3C/tp) local: [q_r | k_r | v_r]; T whole also under --sp
        B, T, C3 = qkv.shape
        Cl = C3 // 3
        hs = Cl // self.local_heads
        q, k, v = qkv.split(Cl, dim=2)  # each (B, T, C/tp)
        q, k, v = (t.view(B, T, self.local_heads, hs).transpose(1, 2) for t in (q, k, v))  # (B, H/tp, T, hs)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, H/tp, T, T)
        att = F.softmax(scores.masked_fill(self.future[:T, :T], float("-inf")), dim=-1)
        y = att @ v  # (B, H/tp, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, Cl)  # this rank's heads side by side
        return self.proj(y)  # RowwiseParallel: whole (B, T, C), or (B, T/tp, C) under --sp

    def forward(self, x):  # x: (B, T, C) replicated, or this rank's (B, T/tp, C) under --sp
        x = x + self.attention(self.ln1(x))
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class TPGPT(nn.Module):
    """pytorch_gpt.GPT's modules with TPBlocks; forward gives the logits, sharded by vocabulary."""

    def __init__(self, gpt, tp):
        super().__init__()
        self.wte, self.wpe, self.lnf, self.lm_head = gpt.wte, gpt.wpe, gpt.lnf, gpt.lm_head
        self.blocks = nn.ModuleList(TPBlock(block, tp) for block in gpt.blocks)

    def forward(self, tokens):  # (B, T) -> (B, T, V) DTensor, Shard(2)
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(T, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.lnf(x))


def tp_plan(L, sp):
    """parallelize_module's plan for TPGPT (see the docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sp else Replicate()  # the residual stream's layout
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:  # without --sp, wpe stays a plain replicated module
        plan["wpe"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
        plan["lnf"] = SequenceParallel()
    for i in range(L):
        plan.update({
            f"blocks.{i}.qkv": ColwiseParallel(input_layouts=seq),
            f"blocks.{i}.proj": RowwiseParallel(output_layouts=seq),
            f"blocks.{i}.fc": ColwiseParallel(input_layouts=seq),
            f"blocks.{i}.fcproj": RowwiseParallel(output_layouts=seq),
        })
        if sp:
            plan[f"blocks.{i}.ln1"] = SequenceParallel()
            plan[f"blocks.{i}.ln2"] = SequenceParallel()
    return plan


def reduce_partial_grads(params):
    """All-reduce, once, the gradients that backward leaves as Partial(sum) DTensors: under --sp the
    replicated LayerNorm weights' (each rank's sum over its own positions). Left Partial, DTensor would
    all-reduce each of them again at every AdamW operation that reads it (3 per parameter and step)."""
    from torch.distributed.tensor import DTensor, Replicate
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=[Replicate()] * len(g.placements))


def local_numel(t):
    return t.to_local().numel() if hasattr(t, "to_local") else t.numel()


def worker(rank, a, port):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    start_rank(rank, a.tp, port)
    N, V, T, L, C, B = a.tp, a.vocab, a.seq, a.layers, a.d_model, a.batch
    mesh = DeviceMesh("cpu", list(range(N)))

    # Every rank builds the whole model from the same seed (pytorch_gpt.GPT's initial
    # weights), permutes the qkv rows, and parallelize_module keeps its shards.
    torch.manual_seed(a.seed)
    gpt = GPT(V, T, L, C, a.heads, sdpa=False)
    total_params = sum(t.numel() for t in gpt.parameters())
    reference = copy.deepcopy(gpt) if a.check and rank == 0 else None
    for block in gpt.blocks:
        permute_qkv_for_tp(block.qkv, C, N)
    model = parallelize_module(TPGPT(gpt, N), mesh, tp_plan(L, a.sp))
    del gpt
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay)
    params = list(model.parameters())
    rank_params = sum(local_numel(t) for t in params)
    global_params = sum(t.numel() for t in model.parameters())  # a DTensor's numel is the whole tensor's
    if reference is not None:
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                                    weight_decay=a.weight_decay)

    gen = torch.Generator().manual_seed(a.seed + 1)  # the same batches on every rank
    times, losses, ref_losses = [], [], []
    for step in range(a.warmup + a.steps):
        data = torch.randint(0, V, (B, T + 1), generator=gen)
        tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(tokens)  # (B, T, V) DTensor sharded by vocabulary
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1))  # mean over the B*T positions
            loss.backward()
        reduce_partial_grads(params)
        opt.step()
        dist.barrier()
        seconds = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(seconds)
        losses.append(loss.to_local().item())  # a replicated DTensor: the same on every rank
        if reference is not None:  # outside the timed window; the other ranks wait at the next barrier
            ref_losses.append(reference_step(reference, ref_opt, tokens, targets))

    counts = torch.tensor([rank_params], dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(N)]
    dist.all_gather(gathered, counts)
    if rank == 0:
        rank_counts = [int(t.item()) for t in gathered]
        assert global_params == total_params, (global_params, total_params)
        ms, tokens_per_s, gflops = step_rates(times, B, T, V, L, C)
        print(f"model: {L} layers, d_model {C}, {a.heads} heads, seq {T}, vocab {V}: {total_params} parameters "
              f"| per rank: {'/'.join(map(str, rank_counts))} (LayerNorms, {'' if a.sp else 'wpe, '}row-parallel biases "
              f"replicated)")
        print(f"batch {B} on every rank | tp {N}{' + sequence parallel' if a.sp else ''}, gloo, cpu, "
              f"1 thread each | DTensor parallelize_module, loss_parallel | AdamW lr {a.lr:g} "
              f"wd {a.weight_decay:g} | torch {torch.__version__}")
        print(f"first step loss {losses[0]:.6f} (ln {V} = {math.log(V):.4f}), last {losses[-1]:.6f}; "
              f"median of {len(times)} timed steps after {a.warmup} warm-up (min {min(times) * 1e3:.1f} ms, "
              f"max {max(times) * 1e3:.1f} ms)")
        max_diff = None
        if reference is not None:
            max_diff = print_loss_check("tp", losses, ref_losses)
        impl = "torch DTensor TP" + (" + SP" if a.sp else "")
        print(f"{'implementation':<24} {'ranks':>5} {'batch':>5} {'ms/step':>9} {'tokens/s':>10} {'GFLOP/s':>8}")
        print(f"{impl:<24} {N:>5} {B:>5} {ms:>9.2f} {tokens_per_s:>10.0f} {gflops:>8.2f}")
        result = dict(implementation="torch.distributed.tensor.parallel", tp=N, sp=a.sp, layers=L, d_model=C,
                      heads=a.heads, seq=T, batch=B, vocab=V, parameters=total_params, rank_parameters=rank_counts,
                      **step_time_fields(times, a.warmup),
                      tokens_per_s=round(tokens_per_s, 1), gflops=round(gflops, 3),
                      first_loss=round(losses[0], 6), final_loss=round(losses[-1], 6),
                      check_max_loss_diff=max_diff, backend="gloo", threads_per_rank=1, torch=torch.__version__)
        print("RESULT " + json.dumps(result), flush=True)
    finish_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks = processes")
    p.add_argument("--sp", action="store_true", help="sequence parallelism for the LayerNorms and residual stream")
    p.add_argument("--batch", type=int, default=8, help="global batch, in sequences (every rank sees all of it)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--check", action="store_true",
                   help="rank 0 also trains the unsplit pytorch_gpt.GPT on the same batches (untimed) and "
                        "prints both losses per step")
    add_multiprocess_args(p)
    a = p.parse_args()
    check_model_args(p, a)
    if a.tp < 1 or a.heads % a.tp != 0:
        p.error(f"--tp {a.tp} must divide --heads {a.heads}: every rank gets whole heads")
    if a.vocab % a.tp != 0:
        p.error(f"--tp {a.tp} must divide --vocab {a.vocab}: the embedding and head are sharded by vocabulary")
    if a.sp and a.seq % a.tp != 0:
        p.error(f"--tp {a.tp} must divide --seq {a.seq} under --sp: the sequence is sharded over the ranks")
    spawn_ranks(worker, a, a.tp)


if __name__ == "__main__":
    main()
