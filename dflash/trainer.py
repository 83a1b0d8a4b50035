"""Single-device DFlash drafter training (arXiv 2602.06036): the frozen target produces hidden
states, the drafter learns to predict each draft block from them.

A step is two separable stages, so a multi-device pipeline (target workers -> prefetch queue ->
drafter workers) can reuse them as they are:

- :func:`produce_target_states`: batch -> :class:`TargetBatch` (target forward, no grad);
- :func:`drafter_step`: :class:`TargetBatch` -> forward + backward of the drafter, returning
  detached loss sums and per-position counts (anchors, draft blocks, BlockMask built here).

:class:`Trainer` wires them into the loop (torchtitan shape: ``train()`` is a short while-loop,
``train_step()`` pulls every micro-batch of the optimizer step, then runs them). The loss is a
weighted *sum*; gradients are divided by the weight sum of the whole optimizer step before
clipping, so grad accumulation equals one big batch (``dflash_reference.md``, Training).

On CUDA the drafter forward + loss runs under ``torch.compile`` with flex_attention and a
BlockMask; on CPU it runs eagerly with SDPA and a dense mask (torch 2.13 has no CPU flex
backward). :class:`CompileMonitor` logs every recompile, graph break and failed frame of the
compiled step as a warning: silently falling back to eager is the failure this project exists
to prevent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash import checkpoint
from dflash.config import INPUT_PATHS, SAVED_CONFIG_NAME, TrainConfig, absolute_path
from dflash.data import Batch, BatchLoader, ShardedSampler, build_examples, read_conversations, require_data_file
from dflash.loss import LossOutput, acceptance_length_estimate, dflash_loss, per_position_accuracy, position_weights
from dflash.masks import build_labels, draft_input_ids, sample_anchors
from dflash.target import Target, TargetStates, load_target, resolve_device

logger = logging.getLogger(__name__)

REGENERATED_NAME = "regenerated_train.jsonl"

# Dense bf16 tensor-core peaks (TFLOP/s) for the MFU estimate, matched against the device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


# ---------------------------------------------------------------------------------------
# The two stages of a step
# ---------------------------------------------------------------------------------------


@dataclass
class TargetBatch:
    """Everything the drafter needs for one micro-batch, on the drafter's device.

    Args:
        input_ids (Tensor): int64 ``[B, S]``.
        loss_mask (Tensor): bool ``[B, S]``.
        states (TargetStates): context ``[B, S, K*H]`` and last hidden ``[B, S, H]`` (no grad).
        num_tokens (int): real (non-padding) tokens.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    states: TargetStates
    num_tokens: int


def produce_target_states(target: Target, batch: Batch) -> TargetBatch:
    """Run the frozen target on a batch and keep what the drafter needs (stage 1)."""
    batch = batch.to(target.device)
    return TargetBatch(
        input_ids=batch.input_ids,
        loss_mask=batch.loss_mask,
        states=target.capture(batch.input_ids),
        num_tokens=batch.num_tokens,
    )


def drafter_forward_loss(
    drafter,
    embed_weight,
    lm_head_weight,
    position_weight,
    input_ids,
    loss_mask,
    context,
    last_hidden,
    anchors,
    valid,
    attention_mask,
    *,
    mask_token_id: int,
    soft_label_weight: float,
    position_weighting: str,
    chunk_blocks: int = 16,
) -> LossOutput:
    """Draft blocks -> drafter -> chunked LM head + weighted loss. The function ``torch.compile``
    wraps on GPU: tensors in, tensors out, the BlockMask built outside."""
    block_size = drafter.config.block_size
    ids = draft_input_ids(input_ids, anchors, valid, block_size, mask_token_id)
    embeds = F.embedding(ids, embed_weight)  # the target's frozen embedding, [B, N*Bs, H]
    hidden = drafter(embeds, context, anchors, valid, attention_mask)
    labels, label_mask = build_labels(input_ids, loss_mask, anchors, valid, block_size)
    return dflash_loss(
        hidden,
        lm_head_weight,
        labels,
        label_mask,
        position_weight,
        chunk_blocks=chunk_blocks,
        position_weighting=position_weighting,
        soft_label_weight=soft_label_weight,
        teacher_hidden=last_hidden if soft_label_weight > 0 else None,
        anchors=anchors,
    )


@dataclass
class DrafterStepOutput:
    """Detached results of :func:`drafter_step` (sums; divide after reducing over the step).

    Args:
        loss (LossOutput): loss sum, weight sum, per-slot correct/total counts.
        valid_blocks (Tensor): scalar, draft blocks with a real anchor (padding blocks excluded).
        attention_pairs (Tensor): scalar, visible (query, key) pairs of the valid blocks, for FLOPs.
    """

    loss: LossOutput
    valid_blocks: torch.Tensor
    attention_pairs: torch.Tensor


def drafter_step(
    step_fn,
    drafter,
    target: Target,
    batch: TargetBatch,
    *,
    max_anchors: int,
    generator: torch.Generator | None,
    position_weight: torch.Tensor,
    autocast: bool,
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
    **loss_kwargs,
) -> DrafterStepOutput:
    """Forward + backward of the drafter on one micro-batch (stage 2).

    Gradients accumulate into the drafter's ``.grad`` from the unnormalised loss *sum*; the
    caller divides by the step's total weight. ``anchors``: pre-sampled ``(anchors, valid)`` on
    the batch's device (the threaded pipeline samples them in job order, ``dflash.pipeline``);
    None samples them here with ``generator``.
    """
    anchors, valid = (
        anchors if anchors is not None else sample_anchors(batch.loss_mask, max_anchors, generator=generator)
    )
    attention_mask = drafter.build_attention_mask(anchors, valid, batch.input_ids.shape[1])
    with torch.autocast(device_type=batch.input_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = step_fn(
            drafter,
            target.embed_tokens.weight,
            target.lm_head.weight,
            position_weight,
            batch.input_ids,
            batch.loss_mask,
            batch.states.context,
            batch.states.last_hidden,
            anchors,
            valid,
            attention_mask,
            **loss_kwargs,
        )
    out.loss_sum.backward()
    block_size = drafter.config.block_size
    pairs = (block_size * (anchors + block_size) * valid).sum()  # block at a sees a context keys + Bs
    return DrafterStepOutput(
        LossOutput(out.loss_sum.detach(), out.weight_sum.detach(), out.correct, out.total), valid.sum(), pairs
    )


# ---------------------------------------------------------------------------------------
# Compile monitoring and throughput
# ---------------------------------------------------------------------------------------


class CompileMonitor:
    """Reports what dynamo did since the last check: compiled frames, graphs, graph breaks and
    frames that failed to compile (which then run eagerly). Every event after the warm-up
    step is logged as a warning with the reason dynamo gives (``torch._logging`` recompiles and
    graph_breaks artifacts are switched on too)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.recompiles = self.graph_breaks = self.failed = 0
        if enabled:
            import torch._logging

            torch._logging.set_logs(recompiles=True, graph_breaks=True)
        self._last = self._snapshot()

    @staticmethod
    def _snapshot() -> dict[str, int]:
        from torch._dynamo.utils import counters

        return {
            "frames": counters["frames"]["total"],
            "ok": counters["frames"]["ok"],
            "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values()),
        }

    def check(self, step: int, *, warmup: bool) -> None:
        if not self.enabled:
            return
        now = self._snapshot()
        delta = {k: now[k] - self._last[k] for k in now}
        self._last = now
        failed = delta["frames"] - delta["ok"]
        self.failed += failed
        self.graph_breaks += delta["breaks"]
        if warmup:
            logger.info("step %d: compiled %d frame(s) into %d graph(s)", step, delta["frames"], delta["graphs"])
        else:
            self.recompiles += delta["frames"]
            if delta["frames"]:
                logger.warning(
                    "step %d: the compiled drafter step RECOMPILED (%d frame(s)); see the "
                    "recompile reason logged above",
                    step,
                    delta["frames"],
                )
        if delta["breaks"]:
            logger.warning(
                "step %d: %d graph break(s) in the compiled drafter step: part of it runs "
                "eagerly (reasons logged above)",
                step,
                delta["breaks"],
            )
        if failed:
            logger.warning("step %d: %d frame(s) failed to compile and run EAGERLY", step, failed)


def detect_peak_tflops(device: torch.device) -> float | None:
    """Dense bf16 peak of a known GPU (``PEAK_TFLOPS``), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def drafter_step_flops(drafter, *, draft_tokens: float, context_tokens: float, visible_pairs: float) -> float:
    """Model FLOPs of drafter training (forward + backward), the MFU numerator.

    Count only useful work: ``draft_tokens`` = valid blocks * Bs (padding blocks excluded),
    ``context_tokens`` = B * S, ``visible_pairs`` = (query, key) pairs the mask allows.
    6 * params * tokens for the drafter layers on the draft tokens and for the context
    ``k_proj``/``v_proj`` on the context tokens; 4 * params * tokens for ``fc`` (its input, the
    target states, needs no grad); 4 * V * H per draft token for the frozen
    LM head (forward + input grad, no weight grad); attention 12 * heads * head_dim per visible
    (query, key) pair per layer (QK^T and PV, forward + backward). Activation recompute of the
    chunked LM head is not counted (model FLOPs, not hardware FLOPs).
    """
    cfg = drafter.config
    layer_params = sum(p.numel() for p in drafter.layers.parameters()) + drafter.norm.weight.numel()
    kv_params = sum(
        layer.self_attn.k_proj.weight.numel() + layer.self_attn.v_proj.weight.numel() for layer in drafter.layers
    )
    # fc reads the frozen target states: forward + weight grad only (4, not 6, per parameter).
    context_flops = (4 * drafter.fc.weight.numel() + 6 * kv_params) * context_tokens
    head_flops = 4 * cfg.vocab_size * cfg.hidden_size * draft_tokens
    attention_flops = 12 * cfg.num_attention_heads * cfg.head_dim * visible_pairs * cfg.num_hidden_layers
    return 6 * layer_params * draft_tokens + context_flops + head_flops + attention_flops


# ---------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------


def _lr_lambda(warmup: int, total: int, min_ratio: float):
    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return schedule


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


class Trainer:
    """Builds target, data, drafter, optimizer from a :class:`TrainConfig` and trains.

    Raises:
        ValueError (incl. DatasetError, TargetLoadError, CheckpointError): bad inputs, with the
            file/flag and the fix in the message.
    """

    def __init__(self, config: TrainConfig):
        from transformers import AutoTokenizer

        from dflash.assets import default_data_dir, default_target_dir
        from dflash.model import DFlashDraftModel, create_drafter_config

        self.config = config
        self.out = Path(config.out)
        _refuse_to_overwrite(self.out, config.resume)
        _check_inputs(config, self.out)  # before the target loads and replies are regenerated
        self.device = resolve_device(config.device)
        self.compiled = config.compile == "on" or (config.compile == "auto" and self.device.type == "cuda")
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        _seed_everything(config.seed)

        target_dir = Path(config.target) if config.target else default_target_dir()
        self.target = load_target(
            target_dir,
            layer_ids=config.target_layer_ids,
            num_capture_layers=config.num_target_layers,
            device=self.device,
        )
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
        regenerate = config.responses == "target" or (
            config.responses == "auto" and not config.target and not config.data
        )
        self.loader = self._build_loader(
            Path(config.data) if config.data else default_data_dir() / "train.jsonl", regenerate=regenerate
        )

        drafter_config = create_drafter_config(
            self.target.config,
            config.num_draft_layers,
            block_size=config.block_size,
            target_layer_ids=self.target.layer_ids,
            mask_token_id=self._mask_token_id(),
        )
        attention = "flex_attention" if self.device.type == "cuda" else "sdpa"
        self.drafter = (
            DFlashDraftModel._from_config(drafter_config, attn_implementation=attention, dtype=torch.float32)
            .to(self.device)
            .train()
        )
        self.step_fn = torch.compile(drafter_forward_loss, dynamic=False) if self.compiled else drafter_forward_loss
        self.monitor = CompileMonitor(self.compiled)

        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(),
            lr=config.lr,
            betas=(0.9, 0.95),
            weight_decay=config.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.total_steps = self._total_steps()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _lr_lambda(config.warmup_steps, self.total_steps, config.min_lr_ratio)
        )
        self.position_weight = position_weights(config.block_size, config.gamma, device=self.device)
        self.anchor_generator = torch.Generator(self.device).manual_seed(config.seed)
        self.step = 0
        self._warmed_up = False  # the first step of this process compiles; later compiles are recompiles
        self.peak_flops = 1e12 * (config.peak_tflops or detect_peak_tflops(self.device) or 0.0)
        if config.resume:
            self.load_checkpoint()
        self.writer = None
        logger.info(
            "drafter: %d layers, %.2fM trainable parameters, block size %d, %s attention%s; "
            "%d steps of %d x %d conversations x %d tokens",
            drafter_config.num_hidden_layers,
            self.num_params / 1e6,
            config.block_size,
            attention,
            " (torch.compile)" if self.compiled else " (eager)",
            self.total_steps,
            config.grad_accum,
            config.batch_size,
            config.seq_len,
        )

    # ---- construction helpers -------------------------------------------------------------

    def _build_loader(self, data_path: Path, *, regenerate: bool) -> BatchLoader:
        cfg = self.config
        conversations = read_conversations(data_path)
        if regenerate:
            conversations, data_path = self._regenerated(conversations), self.out / REGENERATED_NAME
        examples = build_examples(
            self.tokenizer, conversations, seq_len=cfg.seq_len, overflow=cfg.overflow, source=str(data_path)
        )
        sampler = ShardedSampler(len(examples), batch_size=cfg.batch_size, seed=cfg.seed)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        return BatchLoader(examples, sampler, seq_len=cfg.seq_len, pad_token_id=pad)

    def _regenerated(self, conversations):
        """Target-regenerated conversations, cached in ``out`` (reused on --resume)."""
        from dflash.regenerate import regenerate_conversations, write_conversations

        cache = self.out / REGENERATED_NAME
        if self.config.resume and cache.is_file():
            return read_conversations(cache)
        conversations = regenerate_conversations(
            self.target,
            self.tokenizer,
            conversations,
            seq_len=self.config.seq_len,
            max_new_tokens=self.config.regenerate_max_new_tokens,
            progress=self.config.progress,
        )
        self.out.mkdir(parents=True, exist_ok=True)
        write_conversations(cache, conversations)
        return conversations

    def _mask_token_id(self) -> int:
        candidates = (
            self.config.mask_token_id,
            self.tokenizer.mask_token_id,
            getattr(self.target.config, "dflash_mask_token_id", None),
        )
        mask_id = next((c for c in candidates if c is not None), None)
        if mask_id is None:
            raise ValueError(
                "mask_token_id: the target tokenizer has no mask token; pass --mask-token-id "
                "with an existing, rarely used token id (Qwen3: 151669)"
            )
        return mask_id

    def _total_steps(self) -> int:
        if self.config.steps is not None:
            return self.config.steps
        per_epoch = self.loader.sampler.batches_per_epoch / self.config.grad_accum
        return max(1, math.ceil(self.config.epochs * per_epoch))

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.drafter.parameters() if p.requires_grad)

    # ---- the loop ---------------------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        """Whether this process writes logs and checkpoints (always, on one device)."""
        return True

    def train(self) -> dict[str, float]:
        """Train to ``total_steps``; returns the last logged metrics."""
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        cfg = self.config
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / SAVED_CONFIG_NAME).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
            self.writer = SummaryWriter(str(self.out / "tensorboard"), purge_step=self.step + 1)
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not (cfg.progress and self.is_main), desc="train")
        metrics: dict[str, float] = {}
        totals = dict.fromkeys(("steps", "tokens", "step_s", "drafter_s", "drafter_flops"), 0.0)
        try:
            with self._running():
                while self.step < self.total_steps:
                    self.step += 1
                    warm = self._warmed_up
                    metrics = self.train_step()
                    if warm:
                        totals["steps"] += 1
                        for key in ("tokens", "step_s", "drafter_s", "drafter_flops"):
                            totals[key] += metrics[key]
                    bar.update(1)
                    self._report(bar, metrics)
                    if cfg.save_every and self.step % cfg.save_every == 0:
                        self.save_checkpoint()
                if not cfg.save_every or self.step % cfg.save_every:
                    self.save_checkpoint()
        finally:
            bar.close()
            if self.writer is not None:
                self.writer.close()
            if self.is_main:  # also after a failure or Ctrl-C: a soak run ends that way
                self._log_compile_summary()
        if self.is_main:
            self._log_steady_state(totals)
        return metrics

    def _running(self):
        """Context for the loop (the threaded trainer starts and stops its threads here)."""
        return contextlib.nullcontext()

    def _log_due(self) -> bool:
        return self.step % self.config.log_every == 0 or self.step in (1, self.total_steps)

    def _report(self, bar, metrics: dict[str, float]) -> None:
        bar.set_postfix(
            loss=f"{metrics['loss']:.3f}", tau_hat=f"{metrics['tau_hat']:.2f}", tok_s=f"{metrics['tokens_per_s']:.0f}"
        )
        if self._log_due():
            self._log(metrics)

    def _log_compile_summary(self) -> None:
        if self.compiled:
            logger.info(
                "compiled step: %d recompile(s) after warm-up, %d graph break(s), %d frame(s) that "
                "failed to compile and ran eagerly",
                self.monitor.recompiles,
                self.monitor.graph_breaks,
                self.monitor.failed,
            )

    def train_step(self) -> dict[str, float]:
        """One optimizer step over ``grad_accum`` micro-batches; returns its metrics."""
        cfg = self.config
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        data_wait = 0.0
        batches = []
        for _ in range(cfg.grad_accum):
            tick = time.perf_counter()
            batch = next(self.loader)
            data_wait += time.perf_counter() - tick
            batches.append(produce_target_states(self.target, batch))
        if self.device.type == "cuda":  # GPU work is async: sync so the target/drafter split is real
            torch.cuda.synchronize(self.device)
        target_done = time.perf_counter()

        loss_sum = weight_sum = 0.0
        correct = total = 0
        pairs = blocks = 0
        for batch in batches:
            out = drafter_step(
                self.step_fn,
                self.drafter,
                self.target,
                batch,
                max_anchors=cfg.max_anchors,
                generator=self.anchor_generator,
                position_weight=self.position_weight,
                autocast=self.device.type == "cuda",
                mask_token_id=self.drafter.config.mask_token_id,
                soft_label_weight=cfg.soft_label_weight,
                position_weighting="dpace" if cfg.dpace else "decay",
                chunk_blocks=cfg.loss_chunk_blocks,
            )
            loss_sum, weight_sum = loss_sum + out.loss.loss_sum, weight_sum + out.loss.weight_sum
            correct, total = correct + out.loss.correct, total + out.loss.total
            pairs, blocks = pairs + out.attention_pairs, blocks + out.valid_blocks
        # Normalise by the position weights of the whole optimizer step, not per micro-batch.
        grads = [p.grad for p in self.drafter.parameters() if p.grad is not None]
        torch._foreach_div_(grads, weight_sum.clamp(min=1e-8))
        grad_norm = (
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
            if cfg.grad_clip
            else torch.zeros(())
        )
        self.optimizer.step()
        self.scheduler.step()
        self.monitor.check(self.step, warmup=not self._warmed_up)
        self._warmed_up = True

        acc = per_position_accuracy(correct, total)
        loss = float(loss_sum / weight_sum.clamp(min=1e-8))  # one host sync per step, for logging
        elapsed = time.perf_counter() - start
        tokens = sum(b.num_tokens for b in batches)
        metrics = {
            "loss": loss,
            "tau_hat": acceptance_length_estimate(acc),
            "grad_norm": float(grad_norm),
            "lr": self.scheduler.get_last_lr()[0],
            "tokens_per_s": tokens / elapsed,
            "data_wait_frac": data_wait / elapsed,
            "target_frac": (target_done - start - data_wait) / elapsed,
            "step_s": elapsed,
            **{f"acc/{k + 1}": float(a) for k, a in enumerate(acc)},
        }
        drafter_s = time.perf_counter() - target_done
        flops = drafter_step_flops(
            self.drafter,
            draft_tokens=float(blocks) * cfg.block_size,
            context_tokens=cfg.grad_accum * cfg.batch_size * cfg.seq_len,
            visible_pairs=float(pairs),
        )
        metrics.update(tokens=tokens, drafter_s=drafter_s, drafter_flops=flops, drafter_tokens_per_s=tokens / drafter_s)
        if self.peak_flops:
            metrics["drafter_mfu"] = flops / drafter_s / self.peak_flops
        return metrics

    def _log_steady_state(self, totals: dict[str, float]) -> None:
        """Throughput over the steps after this process's first (compile/warm-up) step."""
        if not totals["steps"]:
            return
        mfu = (
            f", drafter MFU {100 * totals['drafter_flops'] / totals['drafter_s'] / self.peak_flops:.1f}% "
            f"of {self.peak_flops / 1e12:.3g} TFLOP/s"
            if self.peak_flops
            else " (pass --peak-tflops for MFU)"
        )
        logger.info(
            "steady state over %d steps: %.0f tok/s end to end, drafter step %.0f tok/s, %.3g TFLOP/s%s",
            totals["steps"],
            totals["tokens"] / totals["step_s"],
            totals["tokens"] / totals["drafter_s"],
            totals["drafter_flops"] / totals["drafter_s"] / 1e12,
            mfu,
        )

    def _log(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, self.step)
        self.writer.flush()
        extra = f" mfu {100 * metrics['drafter_mfu']:.1f}%" if "drafter_mfu" in metrics else ""
        logger.info(
            "step %d/%d loss %.4f tau_hat %.3f acc1 %.3f lr %.2e tok/s %.0f drafter tok/s %.0f "
            "data-wait %.1f%% target %.1f%%%s",
            self.step,
            self.total_steps,
            metrics["loss"],
            metrics["tau_hat"],
            metrics["acc/1"],
            metrics["lr"],
            metrics["tokens_per_s"],
            metrics["drafter_tokens_per_s"],
            100 * metrics["data_wait_frac"],
            100 * metrics["target_frac"],
            extra,
        )

    # ---- checkpoints ------------------------------------------------------------------------

    def training_state(self) -> dict:
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "anchor_rng": self.anchor_generator.get_state(),
            "rng": checkpoint.rng_state(),
            "config": self.config.to_dict(),
        }

    def save_checkpoint(self) -> Path:
        return checkpoint.save_checkpoint(
            self.out,
            self.step,
            weights=self.drafter.state_dict(),
            drafter_config=self.drafter.config.to_diff_dict(),
            training_state=self.training_state(),
            keep_last=self.config.keep_last,
        )

    def load_checkpoint(self) -> None:
        """Restore the latest checkpoint in ``out`` for an exact continuation.

        Raises:
            CheckpointError: no/corrupt checkpoint, or it was trained with a different config.
        """
        step_dir = checkpoint.find_checkpoint(self.out)
        state = checkpoint.load_training_state(step_dir)
        _check_resume_config(state["config"], self.config, step_dir)
        self.drafter.load_state_dict(checkpoint.load_drafter_files(step_dir)[1])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["data"])
        self.anchor_generator.set_state(state["anchor_rng"])
        checkpoint.set_rng_state(state["rng"])
        self.step = state["step"]
        logger.info("resumed from %s at step %d (epoch %d)", step_dir, self.step, self.loader.epoch)


def _refuse_to_overwrite(out: Path, resume: bool) -> None:
    """A new run must not prune, or point ``latest`` away from, another run's checkpoints.

    Raises:
        ValueError: ``out`` already holds checkpoints and ``resume`` is off.
    """
    steps = sorted((out / "checkpoints").glob("step_*")) if (out / "checkpoints").is_dir() else []
    if steps and not resume:
        raise ValueError(
            f"{out} already holds a training run (up to {steps[-1].name}); pass --resume to continue "
            "it, or choose another --out (nothing was changed)"
        )


def _check_inputs(config: TrainConfig, out: Path) -> None:
    """Fail fast on a missing data file or checkpoint, before minutes or hours of loading.

    Raises:
        DatasetError: ``--data`` is not a file.
        CheckpointError: ``--resume`` without a checkpoint in ``out`` (load_checkpoint verifies its files).
    """
    if config.data:
        require_data_file(config.data)
    if config.resume:
        checkpoint.find_checkpoint(out, verify=False)  # load_checkpoint verifies it


# Fields that may change between a run and its resumption without changing the math.
_RESUMABLE_CHANGES = {
    "out",
    "resume",
    "steps",
    "epochs",
    "progress",
    "log_every",
    "save_every",
    "keep_last",
    "device",
    "compile",
    "cpu_threads",
    "peak_tflops",
    "target_devices",
    "prefetch_depth",
}


def _same_input(saved: str | None, current: str | None) -> bool:
    """Whether a saved --target/--data names the file or directory given now.

    Runs saved before input paths were made absolute hold them as typed, relative to where
    that run started. A saved path that does not exist here (another host's mount point) is
    taken as the same input, with a warning, rather than failing only on some ranks.
    """
    if not saved or not current:
        return saved == current
    if absolute_path(saved) == current:
        return True
    if not os.path.exists(saved):
        logger.warning(
            "the run was trained on %s, which does not exist here; taking %s as the same input", saved, current
        )
        return True
    return os.path.exists(current) and os.path.samefile(saved, current)


def _check_resume_config(saved: dict, current: TrainConfig, step_dir: Path) -> None:
    changed = sorted(
        k
        for k, v in current.to_dict().items()
        if k not in _RESUMABLE_CHANGES and k not in INPUT_PATHS and saved.get(k) != v
    )
    changed += [k for k in INPUT_PATHS if not _same_input(saved.get(k), getattr(current, k))]
    if changed:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {getattr(current, k)!r}" for k in changed)
        raise checkpoint.CheckpointError(
            f"{step_dir} was trained with a different config ({details}); resume with the same flags "
            "(see train_config.json in --out; relative paths there are relative to where the run started) "
            "or train into a new --out"
        )
    if (saved.get("steps"), saved.get("epochs")) != (current.steps, current.epochs):
        logger.warning(
            "%s: resuming with a different length (steps %s -> %s, epochs %s -> %s): the learning-rate "
            "schedule is recomputed for the new length, so the continuation is not the run it would have "
            "been",
            step_dir,
            saved.get("steps"),
            current.steps,
            saved.get("epochs"),
            current.epochs,
        )
