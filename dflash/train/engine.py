"""Step engines: each does one optimizer step of drafter training and reports its statistics.

- :class:`~dflash.train.local.LocalEngine`: one device; the target and the drafter run inline
  on the calling thread.
- :class:`~dflash.train.threaded.ThreadedEngine`: target threads -> bounded prefetch queues ->
  drafter threads in one process, gradients averaged over the drafter replicas and, with
  torchrun, over processes.

Both take their micro-batches from one :class:`~dflash.train.jobs.JobSource`, build their
replicas with :func:`~dflash.train.replica.build_replicas` and step them with
:func:`~dflash.train.replica.optimizer_step`, so for the same global batch they compute the
same loss and gradients. The :class:`dflash.train.trainer.Trainer` owns everything around a step
(loop, learning-rate schedule, metrics, logging, checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dflash.train.step import StatsLayout


@dataclass
class StepStats:
    """What one optimizer step did, on the host (this process's share where marked).

    Args:
        loss (float): position-weighted mean loss of the step (all replicas and processes).
        acc (list[float]): per-slot accuracy of slots 1..Bs-1 (a slot with no label: 0).
        grad_norm (float): global grad norm before clipping (0 when clipping is off).
        tokens (int): real (non-padding) tokens trained on, this process.
        row_tokens (int): tokens of the rows, padding included, this process (row fill =
            ``tokens / row_tokens``): what the target forwarded.
        draft_tokens (int): draft tokens trained on (real blocks x block size), this process.
        supervised (int): supervised draft positions, this process: the slots after an anchor with
            a label the loss counted (in the anchor's document, loss mask on); SpecForge's
            throughput unit.
        step_s (float): wall seconds of the step.
        drafter_s (float): drafter busy seconds, summed over this process's replicas.
        target_s (float): target busy seconds, summed over this process's target replicas.
        target_row_tokens (int): tokens of the rows (padding included) the target replicas forwarded
            in ``target_s``, this process: ``row_tokens`` with one device; with target threads the
            rows they finished in the step's time, which run ahead of the drafters' by the prefetch
            buffers (0 when the buffers held every row of the step).
        data_wait_frac (float): share of the step the drafters waited for target states.
        flops (float): drafter model FLOPs of the step, this process
            (:func:`dflash.train.flops.drafter_step_flops`).
        stop (bool): some process asked to stop after this step (SIGTERM/SIGINT).
        selector_loss (float | None): DFlash2's selector cross-entropy, weighted and normalised
            like ``loss`` (not included in it); None for DFlash.
    """

    loss: float
    acc: list[float]
    grad_norm: float
    tokens: int
    row_tokens: int
    draft_tokens: int
    supervised: int
    step_s: float
    drafter_s: float
    target_s: float
    target_row_tokens: int
    data_wait_frac: float
    flops: float
    stop: bool
    selector_loss: float | None = None

    @property
    def tau_hat(self) -> float:
        """The acceptance length estimate ``1 + sum_k prod_{i<=k} acc_i``: a slot counts only if every
        earlier one was accepted, with its accuracy as its acceptance probability (greedy verification);
        the 1 is the bonus token, as in the tau of decoding. Between 1 and Bs."""
        tau, reach = 1.0, 1.0
        for a in self.acc:
            reach *= a
            tau += reach
        return tau


def read_step_stats(stats: torch.Tensor, grad_norm: torch.Tensor, layout: StatsLayout) -> dict:
    """The reduced statistics vector and grad norm on the host, in ONE device-to-host transfer.

    Returns:
        dict: ``loss``, ``acc``, ``grad_norm``, ``blocks``, ``pairs``, ``supervised``, ``stop``,
        ``selector_loss`` (counts and sums: of every replica and process).
    """
    values = torch.cat([stats.float(), grad_norm.reshape(1).float().to(stats.device)]).tolist()
    correct, total = values[layout.correct], values[layout.total]
    weight = max(values[StatsLayout.WEIGHT], 1e-8)
    return {
        "loss": values[StatsLayout.LOSS] / weight,
        # Slot 0 is the given anchor, never predicted.
        "acc": [c / t if t > 0 else 0.0 for c, t in zip(correct[1:], total[1:])],
        "grad_norm": values[-1],
        "blocks": values[StatsLayout.BLOCKS],
        "pairs": values[StatsLayout.PAIRS],
        "supervised": layout.supervised(values),
        "stop": values[StatsLayout.STOP] > 0,
        "selector_loss": values[StatsLayout.SELECTOR] / weight,
    }


class StepEngine(Protocol):
    """The interface of a step engine (what :class:`dflash.train.trainer.Trainer` calls)."""

    drafter: torch.nn.Module  # replica 0: what checkpoints save

    def run(self, step: int, *, lr: float, stop: bool = False) -> StepStats:
        """One optimizer step (number ``step``, 1-based) at learning rate ``lr``; ``stop``: this
        process asks every process to stop after this step."""

    def state_dict(self) -> dict:
        """Optimizer, data position and anchor RNG as of the last completed step (a collective
        with several processes: every rank calls it)."""

    def load_state_dict(self, state: dict, weights: dict) -> None:
        """Restore every replica from a checkpoint's training state and drafter weights."""

    def compile_summary(self) -> dict[str, dict[str, int]]:
        """Per replica: compiles, unexpected recompiles, eager fallbacks, graph breaks."""

    def interval_report(self) -> dict[str, dict[str, float]]:
        """Per thread since the last call, by thread name: busy/wait shares of wall time and tokens/s
        (what a threaded run logs per thread); empty where the work runs inline."""

    def close(self) -> None:
        """Stop threads; safe to call twice and after a failure."""
