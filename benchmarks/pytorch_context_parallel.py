#!/usr/bin/env python3
"""The course's GPT under PyTorch context parallelism (context_parallel, ring attention), for chapter 08.

What it measures: the time of one full context-parallel training step (zero_grad,
forward, the mean cross-entropy, backward, the gradient all-reduce, AdamW on every
rank) of exactly the model in benchmarks/pytorch_gpt.py (our common/model/model.h written in
PyTorch, with F.scaled_dot_product_attention as its attention), the sequence split
over --cp ranks with torch.distributed.tensor.experimental.context_parallel on a 1-D
DeviceMesh("cpu", ...). Every rank is its own process (the script starts them
itself), all on the CPU, gloo backend, one thread per process. Every rank sees the
whole batch of sequences but only its T/cp positions of each; the weights are
replicated, so the gradients are averaged over the ranks (one all-reduce of all of
them, what DDP or FSDP over the cp ranks would do) before AdamW. The step includes
context_parallel's split of the batch. It also times the ring attention itself
(forward and backward, the hops' waits included) on every rank.

  --cp-split contiguous   rank r holds positions r*T/cp .. (r+1)*T/cp - 1
  --cp-split zigzag       2*cp chunks; rank r holds chunks r and 2*cp-1-r (torch's
                          _HeadTailLoadBalancer, the course's zigzag)
  --rotate allgather      torch's default: all-gather every rank's k and v once, then
                          attend block by block ("pass-KV")
  --rotate alltoall       a true ring: each hop passes k, v to the next rank
                          (functional permute_tensor = all_to_all_single)

Whatever --rotate says, the backward passes the k and v gradients around the ring
with all-to-all, as torch does.

Why this script registers two handlers (torch 2.15, and every torch so far): as
shipped, context_parallel does not run on the CPU. It makes q, k, v DTensors sharded
on the sequence and teaches DTensor to run the ring for the CUDA attention kernels
only (aten._scaled_dot_product_flash_attention / _efficient_attention /
_cudnn_attention and their backwards, in _context_parallel/_attention.py and
_sharding_rules.py). On the CPU, F.scaled_dot_product_attention picks
aten._scaled_dot_product_flash_attention_for_cpu, which has neither a ring handler nor
a DTensor sharding rule, so the first forward fails with
  NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default
  does not have a sharding strategy registered.
The other CPU choices fail too: the efficient kernel has no CPU kernel ("No viable
backend for scaled_dot_product_attention was found"), and the math backend adds a
plain-tensor causal mask to DTensor scores ("aten.add.Tensor got mixed torch.Tensor and
DTensor"). The handlers below (cpu_ring_attention_forward and _backward) run torch's
own ring (_templated_ring_attention and _templated_ring_attention_backward, the code
the CUDA kernels use: the same hops, load balance and log-sum-exp merge) with the
CPU flash kernel as the block attention; --as-shipped leaves them out and reproduces
the error.

The positions are split like the tokens: wpe reads each rank's own global positions
(a buffer sharded with the tokens), not 0 .. T/cp - 1. --check has rank 0 also train
the unsplit pytorch_gpt.GPT (explicit attention) on the same batches, untimed, and
print both losses per step: they agree to float rounding.

  python3 benchmarks/pytorch_context_parallel.py --layers 2 --d-model 64 --heads 4 --seq 1024 --batch 2
  python3 benchmarks/pytorch_context_parallel.py --cp-split contiguous --rotate alltoall
  python3 benchmarks/pytorch_context_parallel.py --steps 3 --warmup 0 --check   # losses vs the unsplit model
  python3 benchmarks/pytorch_context_parallel.py --as-shipped --steps 1 --warmup 0   # torch's error on the CPU

It prints a small table and a `RESULT {json}` line for scripts. A reference to measure
against, not part of the course: nothing builds or imports it.
"""
import argparse
import copy
import json
import math
import os
import statistics
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

SEQ_DIM = 2  # the sequence dimension of SDPA's (B, NH, T, hs) q, k, v, out and (B, NH, T) logsumexp
attention_seconds = {"forward": 0.0, "backward": 0.0}  # this rank's ring attention, summed over calls


def cpu_ring_attention_forward(op_call, args, kwargs):
    """DTensor's handler for aten._scaled_dot_product_flash_attention_for_cpu inside
    context_parallel: torch's ring over this rank's q and the rotated k, v blocks."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    q, k, v = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("the CPU ring handler takes no attn_mask (is_causal only)")
    mesh = q.device_mesh
    t0 = time.perf_counter()
    out, lse = cp._templated_ring_attention(
        mesh.get_group(), SEQ_DIM, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        q.to_local(), k.to_local(), v.to_local(), is_causal=is_causal, dropout_p=dropout_p,
        scale=kwargs.get("scale"))
    attention_seconds["forward"] += time.perf_counter() - t0
    return tuple(DTensor.from_local(t, mesh, [Shard(SEQ_DIM)], run_check=False) for t in (out, lse))


def cpu_ring_attention_backward(op_call, args, kwargs):
    """The handler for aten._scaled_dot_product_flash_attention_for_cpu_backward: torch's
    ring backward (dk, dv travel the ring back to their owners)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    grad_out, q, k, v, out, lse, dropout_p, is_causal = args[:8]
    mesh = q.device_mesh
    t0 = time.perf_counter()
    grads = cp._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out.to_local(), grad_out_name="grad_out", query=q.to_local(), key=k.to_local(),
        value=v.to_local(), out=out.to_local(), logsumexp=lse.to_local(), is_causal=is_causal,
        dropout_p=dropout_p, scale=kwargs.get("scale"))
    attention_seconds["backward"] += time.perf_counter() - t0
    return tuple(DTensor.from_local(t, mesh, [Shard(SEQ_DIM)], run_check=False) for t in grads[:3])


def install_cpu_ring_handlers():
    """Adds the two handlers to the ones context_parallel gives DTensor on entering
    (_attention.custom_ops), so they are active only inside the context, like torch's own."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    aten = torch.ops.aten
    cp.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = cpu_ring_attention_forward
    cp.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = cpu_ring_attention_backward


class CPGPT(nn.Module):
    """pytorch_gpt.GPT's modules, with the positions given: under context parallelism a
    rank's positions are its shard's global ones (zigzag: two separate runs of them)."""

    def __init__(self, gpt):
        super().__init__()
        self.wte, self.wpe, self.blocks, self.lnf, self.lm_head = gpt.wte, gpt.wpe, gpt.blocks, gpt.lnf, gpt.lm_head

    def forward(self, tokens, positions, targets):  # each (B, T/cp) -> this rank's mean cross-entropy
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.lnf(x))  # (B, T/cp, V)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def average_gradients(params, world):
    """All-reduce every gradient, once, in one flat buffer, and divide by the ranks: each
    rank's loss is the mean over its T/cp positions, the global loss the mean of those."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])  # (number of parameters,)
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def worker(rank, a, port):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    start_rank(rank, a.cp, port)
    N, V, T, L, C, B = a.cp, a.vocab, a.seq, a.layers, a.d_model, a.batch
    mesh = DeviceMesh("cpu", list(range(N)))
    set_rotate_method(a.rotate)
    _cp_options.enable_load_balance = a.cp_split == "zigzag"  # read by context_parallel on entering
    if not a.as_shipped:
        install_cpu_ring_handlers()

    torch.manual_seed(a.seed)  # every rank: pytorch_gpt.GPT's initial weights
    gpt = GPT(V, T, L, C, a.heads, sdpa=True)
    n_params = sum(t.numel() for t in gpt.parameters())
    reference = copy.deepcopy(gpt) if a.check and rank == 0 else None
    if reference is not None:
        for block in reference.blocks:
            block.sdpa = False  # the explicit T x T attention, unsplit
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                                    weight_decay=a.weight_decay)
    model = CPGPT(gpt)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay)

    gen = torch.Generator().manual_seed(a.seed + 1)  # the same batches on every rank
    times, losses, ref_losses, attn_ms = [], [], [], []
    for step in range(a.warmup + a.steps):
        data = torch.randint(0, V, (B, T + 1), generator=gen)
        tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        positions = torch.arange(T).expand(B, T).contiguous()
        shards = [tokens.clone(), positions, targets.clone()]  # context_parallel shards these in place
        attention_seconds.update(forward=0.0, backward=0.0)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        try:
            with context_parallel(mesh, buffers=shards, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(shards)):
                loss = model(*shards)  # this rank's (B, T/cp) positions
                loss.backward()
        except (NotImplementedError, RuntimeError) as e:
            if rank == 0:
                print(f"torch {torch.__version__}: context_parallel failed on the CPU: {type(e).__name__}: "
                      f"{str(e).splitlines()[0]}", flush=True)
                a.failed.value = 1
            finish_process_group()
        average_gradients(params, N)
        opt.step()
        dist.barrier()
        seconds = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(seconds)
            attn_ms.append((attention_seconds["forward"] * 1e3, attention_seconds["backward"] * 1e3))
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / N)
        if reference is not None:  # outside the timed window; the other ranks wait at the next barrier
            ref_losses.append(reference_step(reference, ref_opt, tokens, targets))

    # every rank's median attention forward and backward ms per step
    mine = torch.tensor([statistics.median(f for f, _ in attn_ms), statistics.median(b for _, b in attn_ms)])
    gathered = [torch.zeros(2) for _ in range(N)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        report(a, n_params, times, losses, ref_losses, [g.tolist() for g in gathered])
    finish_process_group()


def report(a, n_params, times, losses, ref_losses, rank_attn_ms):
    N, V, T, L, C, B = a.cp, a.vocab, a.seq, a.layers, a.d_model, a.batch
    ms, tokens_per_s, gflops = step_rates(times, B, T, V, L, C)
    print(f"model: {L} layers, d_model {C}, {a.heads} heads, seq {T}, vocab {V}: {n_params} parameters "
          f"(replicated on every rank)")
    print(f"batch {B}, every rank {T // N} positions of each sequence | cp {N} ({a.cp_split} split, rotate "
          f"{a.rotate}), gloo, cpu, 1 thread each | context_parallel + SDPA (CPU flash kernel in torch's ring) "
          f"| AdamW lr {a.lr:g} wd {a.weight_decay:g} | torch {torch.__version__}")
    print(f"first step loss {losses[0]:.6f} (ln {V} = {math.log(V):.4f}), last {losses[-1]:.6f}; "
          f"median of {len(times)} timed steps after {a.warmup} warm-up (min {min(times) * 1e3:.1f} ms, "
          f"max {max(times) * 1e3:.1f} ms)")
    max_diff = None
    if ref_losses:
        max_diff = print_loss_check("cp", losses, ref_losses)
    print(f"{'implementation':<28} {'ranks':>5} {'split':>10} {'rotate':>9} {'batch':>5} {'ms/step':>9} "
          f"{'tokens/s':>9} {'GFLOP/s':>8}")
    print(f"{'torch context_parallel':<28} {N:>5} {a.cp_split:>10} {a.rotate:>9} {B:>5} {ms:>9.2f} "
          f"{tokens_per_s:>9.0f} {gflops:>8.2f}")
    print(f"{'rank':>4} {'attention fwd ms':>17} {'attention bwd ms':>17}   "
          f"(median per step, all layers, ring waits included)")
    for r, (fwd, bwd) in enumerate(rank_attn_ms):
        print(f"{r:>4} {fwd:>17.2f} {bwd:>17.2f}")
    result = dict(implementation="torch.distributed.tensor.experimental.context_parallel", cp=N,
                  cp_split=a.cp_split, rotate=a.rotate, layers=L, d_model=C, heads=a.heads, seq=T, batch=B, vocab=V,
                  parameters=n_params, **step_time_fields(times, a.warmup), tokens_per_s=round(tokens_per_s, 1),
                  gflops=round(gflops, 3), attention_ms_per_rank=[[round(x, 3) for x in r] for r in rank_attn_ms],
                  first_loss=round(losses[0], 6), final_loss=round(losses[-1], 6), check_max_loss_diff=max_diff,
                  cpu_ring_handlers=True, backend="gloo", threads_per_rank=1, torch=torch.__version__)
    print("RESULT " + json.dumps(result), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, default=2, help="context-parallel ranks = processes")
    p.add_argument("--cp-split", choices=["contiguous", "zigzag"], default="zigzag",
                   help="how the sequence is split (zigzag: torch's head-tail load balancer)")
    p.add_argument("--rotate", choices=["allgather", "alltoall"], default="allgather",
                   help="torch's set_rotate_method for k and v in the forward")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (every rank holds part of each)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--check", action="store_true",
                   help="rank 0 also trains the unsplit pytorch_gpt.GPT on the same batches (untimed) and "
                        "prints both losses per step")
    p.add_argument("--as-shipped", action="store_true",
                   help="without this script's CPU ring handlers: shows torch's own error on the CPU")
    add_multiprocess_args(p)
    a = p.parse_args()
    check_model_args(p, a)
    chunks = 2 * a.cp if a.cp_split == "zigzag" else a.cp
    if a.cp < 1 or a.seq % chunks != 0:
        p.error(f"--seq {a.seq} must divide into {chunks} equal chunks (--cp {a.cp}, {a.cp_split} split)")
    import torch.multiprocessing as mp
    a.failed = mp.get_context("spawn").Value("b", 0)  # set by rank 0 when torch fails (it prints why)
    spawn_ranks(worker, a, a.cp)
    sys.exit(1 if a.failed.value else 0)


if __name__ == "__main__":
    main()
