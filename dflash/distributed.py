"""Gradient averaging for data-parallel drafter replicas: across the drafter threads of one
process and across processes (``torchrun``, one process per host).

Each replica keeps every trainable parameter's ``.grad`` as a view into one flat fp32 buffer
(:class:`FlatGradients`, DDP's ``gradient_as_bucket_view`` idea), with a few extra slots at the
end for the step statistics (loss sum, position-weight sum, accuracy counts), so one collective
per optimizer step carries gradients and statistics together. :func:`sum_replicas` makes every
buffer the sum over all replicas of all processes:

- CUDA: ``torch.cuda.nccl.all_reduce`` over the replicas' devices (one process), or
  ``nccl.reduce`` to replica 0, ``torch.distributed.all_reduce`` (NCCL) across processes, then
  ``nccl.broadcast`` back (several processes).
- CPU: a host sum in replica order (deterministic), ``torch.distributed.all_reduce`` (gloo)
  across processes, copied back into every buffer.

Every replica then takes the same optimizer step on the same summed gradients, so replicas stay
bit-identical without broadcasting weights (as DDP does). Process groups come from the
``torchrun`` environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ProcessInfo:
    """This process's place in a ``torchrun`` job (all 0/1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> ProcessInfo:
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (set by torchrun).

        Raises:
            ValueError: inconsistent values (rank outside [0, world_size)).
        """
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if world < 1 or not 0 <= rank < world:
            raise ValueError(
                f"RANK={rank}, WORLD_SIZE={world}: not a valid torchrun environment; start with "
                "torchrun --nnodes N --nproc-per-node 1 or without torchrun"
            )
        return cls(rank, world, int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_process_group(info: ProcessInfo, device: torch.device) -> None:
    """Join the torchrun job: gloo for CPU replicas, NCCL for CUDA ones (``device`` = this
    process's first drafter device, the one its cross-process collectives run on). No-op for
    one process or when already initialised."""
    if info.world_size == 1 or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=info.rank, world_size=info.world_size, device_id=device)
    else:
        dist.init_process_group("gloo", rank=info.rank, world_size=info.world_size)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class FlatGradients:
    """The ``.grad`` of every trainable parameter of ``module`` as views into one flat fp32
    buffer, followed by ``extra`` statistic slots (:attr:`stats`).

    Autograd accumulates into existing ``.grad`` tensors in place, so backward fills the
    buffer directly. Never set ``.grad`` to None (``optimizer.zero_grad(set_to_none=True)``):
    call :meth:`zero_` instead.

    Raises:
        ValueError: a trainable parameter that is not fp32 or not on the module's device.
    """

    def __init__(self, module: torch.nn.Module, extra: int = 0):
        self.params = [p for p in module.parameters() if p.requires_grad]
        device = self.params[0].device
        bad = [p.dtype for p in self.params if p.dtype != torch.float32 or p.device != device]
        if bad:
            raise ValueError(
                f"flat gradients need fp32 parameters on one device; found {bad[0]}: keep the "
                "drafter's master weights in fp32 (bf16 compute comes from autocast)"
            )
        numel = sum(p.numel() for p in self.params)
        self.buffer = torch.zeros(numel + extra, dtype=torch.float32, device=device)
        offset = 0
        for p in self.params:
            p.grad = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.grads = [p.grad for p in self.params]
        self.grad_buffer = self.buffer[:numel]
        self.stats = self.buffer[numel:]

    def zero_(self) -> None:
        self.buffer.zero_()

    def check_views(self) -> None:
        """Raise RuntimeError if something replaced a ``.grad`` (its updates would be lost)."""
        for p, g in zip(self.params, self.grads):
            if p.grad is not g:
                raise RuntimeError(
                    "a drafter parameter's .grad was replaced (zero_grad(set_to_none=True)?); "
                    "gradients would no longer be averaged"
                )


def sum_replicas(buffers: list[torch.Tensor]) -> None:
    """In place: every buffer becomes the sum of all buffers of this process and, when a
    process group is initialised, of all processes (module docstring).

    Args:
        buffers: one fp32 1-D tensor per replica, same length; on distinct GPUs, or all on CPU.
    """
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if buffers[0].device.type == "cuda":
        from torch.cuda import nccl

        if not distributed:
            if len(buffers) > 1:
                nccl.all_reduce(buffers)
            return
        if len(buffers) > 1:
            nccl.reduce(buffers, root=0)
        dist.all_reduce(buffers[0])
        if len(buffers) > 1:
            nccl.broadcast(buffers, root=0)
        return
    if len(buffers) == 1 and not distributed:
        return
    total = buffers[0].clone()
    for other in buffers[1:]:  # a fixed order: the same bits on every run
        total += other
    if distributed:
        dist.all_reduce(total)
    for buffer in buffers:
        buffer.copy_(total)


def gather_objects(value) -> list:
    """``[value of rank 0, value of rank 1, ...]`` (just ``[value]`` without a process group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def barrier(timeout: timedelta | None = None) -> None:
    """Wait for every process (no-op without a process group).

    Args:
        timeout: wait up to this long, on a gloo group of its own made for it (collectively, on
            the first call with this value): the default group's collective timeout (10 minutes
            for NCCL) is too short for work that may finish minutes apart on different hosts.
            A process that dies still ends the wait at once (its sockets close).
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    dist.barrier(group=None if timeout is None else _gloo_group(timeout))


def broadcast_from_main(value, timeout: timedelta = timedelta(hours=24)):
    """Rank 0's ``value`` (picklable) on every process; ``value`` as given without a process group.
    Sent on the gloo group of :func:`barrier` with ``timeout`` (rank 0 may take long to decide)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=_gloo_group(timeout))
    return box[0]


@functools.cache
def _gloo_group(timeout: timedelta):
    return dist.new_group(backend="gloo", timeout=timeout)
