"""Drafter replicas and the optimizer step they take together.

A replica is one device's copy of the drafter with its frozen heads (the target's embedding and
LM head on that device), its optimizer, its compiled step function and a flat gradient buffer
whose tail holds the step statistics (:class:`dflash.train.step.StatsLayout`). Every replica of
every process takes the same step from the same summed gradients (:func:`optimizer_step`), so
replicas stay bit-identical without broadcasting weights, as DDP does. The local engine has one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from dflash.compile_watch import DynamoWarnings, StepWatch
from dflash.distributed import FlatGradients, sum_replicas
from dflash.drafter.codebooks import ProjectedSelector
from dflash.train.loss_settings import LossSettings
from dflash.train.regions import compile_step
from dflash.train.step import StatsLayout, drafter_forward_loss

ADAM_BETAS = (0.9, 0.95)


@dataclass
class Heads:
    """The target's frozen embedding and LM head on a replica's device."""

    embed_tokens: torch.nn.Module
    lm_head: torch.nn.Module


@dataclass
class DrafterReplica:
    """One device's drafter, frozen heads, optimizer, compiled step, gradient + statistics buffer.

    Args:
        name (str): the replica's name in logs (``drafter0 (cuda:1)``).
        device (torch.device)
        model (AnchoredDrafter): fp32 master weights; bf16 compute comes from autocast.
        heads (Heads)
        optimizer (torch.optim.Optimizer): AdamW (:func:`build_optimizer`).
        flat (FlatGradients): ``.grad`` views, then the :class:`StatsLayout` slots.
        position_weight (Tensor): float32 ``[Bs]`` on ``device``.
        step_fn: :func:`drafter_forward_loss` or its compiled form (:func:`dflash.train.regions.compile_step`).
        watch (StepWatch): compile accounting of ``step_fn``'s regions in this replica's thread.
    """

    name: str
    device: torch.device
    model: torch.nn.Module
    heads: Heads
    optimizer: torch.optim.Optimizer
    flat: FlatGradients
    position_weight: torch.Tensor
    step_fn: object
    watch: StepWatch


def build_optimizer(model: torch.nn.Module, config) -> torch.optim.Optimizer:
    """Fused AdamW over the trainable parameters (one kernel per step, CPU and CUDA; it also takes
    the step's gradient scale, see :func:`optimizer_step`); the learning rate is set every step by
    the trainer's schedule.

    Its moments are allocated here, as zeros at step 0 (what AdamW's first step would create for
    every parameter: each has a ``.grad``, :class:`dflash.distributed.FlatGradients`), not in the
    first step: their memory (twice the trainable weights, 15 GiB for the user's 1.9B-parameter
    DFlash2 drafter) then counts from the start, so a run that cannot fit should run out of memory
    in step 1, not after a first step and its compile (seen in step 2 at batch 4 on an H100)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=ADAM_BETAS, weight_decay=config.weight_decay, fused=True)
    zeros = {
        index: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        for index, p in enumerate(params)
    }
    optimizer.load_state_dict({"state": zeros, "param_groups": optimizer.state_dict()["param_groups"]})
    return optimizer


def _heads_on(device: torch.device, targets) -> Heads:
    """The frozen heads of a target on ``device`` if one is there, else a copy of the first's."""
    local = next((t for t in targets if t.device == device), None)
    if local is not None:
        return Heads(local.embed_tokens, local.lm_head)
    source = targets[0]
    return Heads(copy.deepcopy(source.embed_tokens).to(device), copy.deepcopy(source.lm_head).to(device))


def build_replicas(
    drafter: torch.nn.Module,
    slots,
    targets,
    config,
    settings: LossSettings,
    *,
    compiled: bool,
    warnings: DynamoWarnings,
    backend: str = "inductor",
    scope: str = "step",
) -> list[DrafterReplica]:
    """One :class:`DrafterReplica` per drafter slot, each a copy of ``drafter``'s initial weights.

    Compiled replicas get their own compiled regions of the step (``scope``,
    :func:`dflash.train.regions.compile_step`): their own code objects, so their own dynamo
    caches and recompile limits, compiled with ``dynamic=False`` through ``backend``.
    """
    layout = StatsLayout(settings.block_size)
    replicas = []
    for index, slot in enumerate(slots):
        model = (drafter if index == 0 else copy.deepcopy(drafter)).to(slot.device)
        step_fn, regions = compile_step(scope, index, backend) if compiled else (drafter_forward_loss, [])
        name = f"drafter{index} ({slot.name})"
        replicas.append(
            DrafterReplica(
                name=name,
                device=slot.device,
                model=model,
                heads=_heads_on(slot.device, targets),
                optimizer=build_optimizer(model, config),
                flat=FlatGradients(model, extra=layout.size),
                position_weight=settings.position_weight(slot.device),
                step_fn=step_fn,
                watch=StepWatch(name, regions, warnings),
            )
        )
    # After every copy is made, so none copies another device's embeddings.
    for replica in replicas:
        selector = getattr(replica.model, "candidate_selector", None)
        if isinstance(selector, ProjectedSelector):
            selector.attach(replica.heads.embed_tokens.weight, replica.heads.lm_head.weight)
    return replicas


def optimizer_step(replicas: list[DrafterReplica], *, lr: float, grad_clip: float) -> torch.Tensor:
    """Sum gradients and statistics over all replicas and processes, then step every replica at
    ``lr`` on the gradients divided by the step's total position weight W and clipped to a global
    norm of ``grad_clip`` (0 = off).

    Division and clipping are one scale, ``min(1 / W, grad_clip / ||g||)`` for the summed
    gradient g, which the fused AdamW kernel applies as it reads the gradients
    (``optimizer.grad_scale`` divides by its inverse): one pass over the gradients for their norm
    and the optimizer's own, instead of three more (divide, norm, clip).

    Returns:
        Tensor: 0-d float32 norm of the divided gradients before clipping, on replica 0's device;
        no host sync.
    """
    sum_replicas([r.flat.buffer for r in replicas])
    grad_norm = None
    for r in replicas:
        r.flat.check_views()
        weight = r.flat.stats[StatsLayout.WEIGHT].clamp(min=1e-8)
        norm = torch.linalg.vector_norm(r.flat.grad_buffer) / weight
        inverse_scale = torch.maximum(weight, norm * weight / grad_clip) if grad_clip else weight
        r.optimizer.grad_scale = inverse_scale.float()
        for group in r.optimizer.param_groups:
            group["lr"] = lr
        r.optimizer.step()
        grad_norm = norm if grad_norm is None else grad_norm
    return grad_norm


def load_replica_state(replicas: list[DrafterReplica], weights: dict, optimizer_state: dict) -> None:
    """Load the same weights and optimizer state into every replica."""
    for r in replicas:
        r.model.load_state_dict(weights)
        # The zero moments build_optimizer made go first: held while the loaded ones are cast, they
        # would double the moments' memory for the load.
        r.optimizer.state.clear()
        # A copy each: load_state_dict keeps same-device state tensors as they are, so replicas
        # would share (and triple-update) one set of Adam moments.
        r.optimizer.load_state_dict(copy.deepcopy(optimizer_state))
