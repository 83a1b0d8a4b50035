"""DFlash drafter training (arXiv 2602.06036): the loop around a step engine.

:class:`Trainer` conducts: from a settled config (:func:`dflash.run.settle.settle`) it has each
room build its part once, the training data (:mod:`dflash.train.corpus`), the targets in the run's
precision (:mod:`dflash.train.targets`), the held-out prompts (:mod:`dflash.train.heldout`), the
initial drafter and the loss settings (:mod:`dflash.train.loss_settings`), hands them to a step
engine (:mod:`dflash.train.engine`: one device, or target and drafter threads) and owns everything
around a step: the loop, the learning-rate schedule, checkpoints and exact resume, and a clean stop
on SIGTERM/SIGINT. What each step's figures are and where they are written is
:mod:`dflash.train.metrics`'s.

Shape of the loop (torchtitan's): ``train()`` is a short while-loop; each step asks the engine
for one optimizer step at the schedule's learning rate and gets back host-side statistics
(:class:`dflash.train.engine.StepStats`, one device-to-host transfer per step).

Stopping: the first SIGTERM (what SLURM and Kubernetes send before killing a job) or SIGINT
finishes the step in flight, saves a checkpoint (with torchrun, every process stops after the
same step: the request travels with the step's gradients) and raises :class:`dflash.signals.Stopped`;
a second signal ends the process at once (the checkpoints on disk stay intact: writes are atomic).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import signal
import time
from pathlib import Path

import torch

from dflash import profiling, watchdog
from dflash.assets import default_target_dir
from dflash.compile_watch import DynamoWarnings
from dflash.config import TrainConfig
from dflash.devices import DeviceLayout, Slot, compute_dtype, parse_layout, resolve_device, set_cpu_threads
from dflash.distributed import ProcessInfo, barrier, destroy_process_group, init_process_group
from dflash.drafter.codebooks import project_codebooks, published_state_dict
from dflash.drafter.files import CONFIG_NAME, CheckpointError
from dflash.drafter.mask_token import resolve_mask_token_id
from dflash.drafter.model import AnchoredDrafter, architecture_name, drafter_config, load_drafter_dir
from dflash.patching.status import thread_safety_gap
from dflash.progress_logging import log_above_progress_bars
from dflash.run import checkpoint, compile_cache
from dflash.run.layout import SAVED_CONFIG_NAME, check_free_space, checkpoint_bytes
from dflash.run.out_of_memory import rows_text
from dflash.run.preflight import check_drafter_config
from dflash.run.resume import check_process_count, check_resume_config
from dflash.run.step_dirs import find_checkpoint
from dflash.signals import Stopped, StopRequest
from dflash.target_model.files import load_tokenizer
from dflash.train.corpus import Corpus
from dflash.train.drafter_rows import row_counts
from dflash.train.engine import StepEngine
from dflash.train.flops import detect_peak_tflops
from dflash.train.heldout import HeldOutAcceptance
from dflash.train.jobs import JobSource, seq_len_schedule
from dflash.train.local import LocalEngine
from dflash.train.loss_settings import LossSettings
from dflash.train.metrics import MetricsLog, Throughput, progress_postfix
from dflash.train.regions import GRAPHS_PER_SHAPE
from dflash.train.replica import build_replicas
from dflash.train.targets import load_targets
from dflash.train.threaded import ThreadedEngine

logger = logging.getLogger(__name__)


def learning_rate(step: int, config: TrainConfig, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based): linear warm-up over
    ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``."""
    k = step - 1
    if k < config.warmup_steps:
        return config.lr * (k + 1) / config.warmup_steps
    progress = min(1.0, (k - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _warn_if_warmup_is_the_run(config: TrainConfig, total_steps: int) -> None:
    """A warm-up as long as the run never reaches --lr: say so, with the peak it reaches."""
    if config.warmup_steps >= total_steps:
        logger.warning(
            "--warmup-steps %d is not shorter than the run's %d steps: the learning rate rises for the whole run and "
            "peaks at %.0f%% of --lr %g; pass %s",
            config.warmup_steps,
            total_steps,
            100 * learning_rate(total_steps, config, total_steps) / config.lr,
            config.lr,
            f"--warmup-steps {total_steps // 10} (about a tenth of the steps) or more --steps"
            if total_steps >= 10
            else "--warmup-steps 0 or more --steps",
        )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def resolve_layout(config: TrainConfig, process: ProcessInfo) -> tuple[DeviceLayout, bool]:
    """The device layout and whether it is threaded (``--target-devices``/``--drafter-devices``).

    Raises:
        ValueError: a bad device name or spec; several torchrun processes without the threaded
            layout.
    """
    if config.drafter_devices is not None:
        return parse_layout(config.target_devices, config.drafter_devices).shifted(process.local_rank), True
    if process.world_size > 1:
        raise ValueError(
            "torchrun with several processes needs the threaded layout: pass --target-devices and --drafter-devices"
        )
    device = resolve_device(config.device)
    slot = Slot(str(device), device)
    return DeviceLayout((slot,), (slot,)), False


class Trainer:
    """Builds targets, data, drafter and a step engine from a settled :class:`TrainConfig`
    (:func:`dflash.run.settle.settle`: the drafter's shape resolved, every input checked), and trains.

    Raises:
        ValueError (incl. DatasetError, TargetLoadError, CheckpointError, DeviceSpecError): bad
            inputs, with the file/flag and the fix in the message.
        dflash.train.threaded.PipelineError: a thread of the threaded engine failed.
    """

    def __init__(self, config: TrainConfig):

        if config.block_size is None or config.num_draft_layers is None:  # settle() fills both
            raise ValueError("Trainer takes a settled config: pass it through dflash.run.settle.settle first")
        self.config = config
        logger.debug("config: %s", json.dumps(config.to_dict(), sort_keys=True))
        self.out = Path(config.out)
        check_drafter_config(config)  # the drafter's config from the target's config.json, before the target loads
        self.process = ProcessInfo.from_env()
        self.layout, self.threaded = resolve_layout(config, self.process)
        init_process_group(self.process, self.layout.drafters[0].device)
        set_cpu_threads(config.cpu_threads, self.layout.device_type)
        if not config.progress:  # transformers draws its own bars (loading weights)
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
        _seed_everything(config.seed)
        device = self.layout.targets[0].device
        self.compiled = config.compile == "on" or (config.compile == "auto" and device.type == "cuda")
        if not self.compiled and config.compile_scope != TrainConfig.defaults()["compile_scope"]:
            logger.warning(
                "--compile-scope %s has no effect: the drafter step runs eagerly (--compile %s on %s); pass "
                "--compile on to compile it",
                config.compile_scope,
                config.compile,
                device.type,
            )

        target_dir = Path(config.target) if config.target else default_target_dir()
        self.tokenizer = load_tokenizer(target_dir)
        # Every line checked, and the examples (or, to regenerate, the prompts) found, before the target loads.
        self.corpus = Corpus(config, self.tokenizer, target_dir, self.process)
        self.heldout = (
            HeldOutAcceptance(config, self.tokenizer, target_dir)
            if config.measures_acceptance and self.is_main
            else None
        )
        targets = load_targets(config, target_dir, self.layout.targets, compiled=self.compiled)
        self.loader = self.corpus.loader(targets)
        drafter = self._build_drafter(targets[0])
        if config.save and self.is_main:  # before the steps a failed first save would lose
            check_free_space(self.out, checkpoint_size=self._checkpoint_size(drafter), keep_last=config.keep_last)
        self.eval_target = targets[0]
        self.settings = LossSettings.from_config(
            config,
            block_size=drafter.config.block_size,
            mask_token_id=drafter.config.mask_token_id,
            selector=drafter.config.is_dflash2,
        )
        self.dynamo_warnings = DynamoWarnings()
        self.total_steps = self._total_steps()
        _warn_if_warmup_is_the_run(config, self.total_steps)
        self.engine: StepEngine = self._build_engine(targets, drafter)
        self.step = 0
        self.peak_flops = 1e12 * (config.peak_tflops or detect_peak_tflops(self.layout.drafters[0].device) or 0.0)
        if config.resume:
            self.load_checkpoint()
        if self.threaded:
            _warn_if_unpatched(self.compiled, len(self.layout.drafters))
        if not config.save:
            logger.warning("--no-save: no checkpoint will be written, this run cannot be resumed or evaluated")
        logger.info(
            "drafter: %s, %d layer(s) of %d heads x %d (%d KV heads), hidden %d, %.2fM trainable parameters, block "
            "size %d, %s attention%s; %d steps of %d replica(s) x %d micro-batch(es) x %d rows%s x %d tokens (%s); %s "
            "(process %d/%d)",
            architecture_name(drafter.config),
            drafter.config.num_hidden_layers,
            drafter.config.num_attention_heads,
            drafter.config.head_dim,
            drafter.config.num_key_value_heads,
            drafter.config.hidden_size,
            sum(p.numel() for p in drafter.parameters() if p.requires_grad) / 1e6,
            config.block_size,
            drafter.config._attn_implementation,
            f" (torch.compile, {config.compile_scope})" if self.compiled else " (eager)",
            self.total_steps,
            len(self.layout.drafters),
            config.grad_accum,
            config.batch_size,
            f" ({config.drafter_rows} per drafter forward)" if config.drafter_rows else "",
            config.seq_len,
            "packed" if config.pack else "one conversation per row",
            self._layout_words(),
            self.process.rank,
            self.process.world_size,
        )

    # ---- construction -----------------------------------------------------------------------

    def _resumed_drafter_config(self) -> dict:
        """``config.json`` of the checkpoint ``--resume`` continues; {} for a new run."""
        if not self.config.resume:
            return {}
        step_dir = find_checkpoint(self.out, verify=False)
        return json.loads((step_dir / CONFIG_NAME).read_text())

    def _mask_token_id(self, target, resumed: dict) -> int:
        """``--mask-token-id``, else the ``resumed`` drafter's, else the target tokenizer's choice
        (:func:`dflash.drafter.mask_token.resolve_mask_token_id`; logged with its source)."""
        mask_id, _ = resolve_mask_token_id(
            explicit=self.config.mask_token_id,
            drafter_config=resumed.get("dflash_config"),
            tokenizer=self.tokenizer,
            vocab_size=target.embed_tokens.num_embeddings,
        )
        return mask_id

    def _build_drafter(self, target):
        cfg = self.config
        attention = "flex_attention" if self.layout.device_type == "cuda" else "sdpa"
        if cfg.init_from:
            logger.info("drafter: starting from %s (its shape, RoPE and weights)", cfg.init_from)
            return load_drafter_dir(cfg.init_from, dtype=torch.float32, attn_implementation=attention).train()
        resumed = self._resumed_drafter_config()
        # A resumed run keeps the causality it was trained with (runs saved before the engines' rule
        # was followed say is_causal false); a new one takes the rule (dflash.drafter.modeling_dflash).
        config = drafter_config(
            cfg,
            target.config,
            target_layer_ids=target.layer_ids,
            mask_token_id=self._mask_token_id(target, resumed),
            is_causal=resumed.get("is_causal"),
        )
        # Built on the host from the seeded RNG: the same initial weights on CPU and GPU.
        drafter = AnchoredDrafter._from_config(config, attn_implementation=attention, dtype=torch.float32).train()
        if cfg.selector_codebooks == "projected":
            project_codebooks(drafter)
        return drafter

    def _build_engine(self, targets, drafter) -> StepEngine:
        cfg = self.config
        replicas = build_replicas(
            drafter,
            self.layout.drafters,
            targets,
            cfg,
            self.settings,
            compiled=self.compiled,
            warnings=self.dynamo_warnings,
            scope=cfg.compile_scope,
        )
        seq_lens = seq_len_schedule(cfg.seq_len, cfg.vary_seq_len)
        # Anchors are drawn on the host in job order, one stream per process.
        source = JobSource(
            self.loader,
            torch.Generator().manual_seed(cfg.seed + self.process.rank),
            num_drafters=len(replicas),
            grad_accum=cfg.grad_accum,
            max_anchors=cfg.max_anchors,
            seq_lens=seq_lens,
            pin=self.layout.device_type == "cuda",
        )
        # A region compiles its graphs per length and per rows per drafter forward, and a first step
        # that runs out of memory in the drafter tries fewer rows (dflash.train.drafter_rows).
        shapes = len(seq_lens) * len(row_counts(cfg.batch_size, cfg.drafter_rows or cfg.batch_size))
        common = dict(
            grad_accum=cfg.grad_accum,
            batch_size=cfg.batch_size,
            drafter_rows=cfg.drafter_rows or None,
            grad_clip=cfg.grad_clip,
            last_step=self.total_steps,
            recompile_limit=GRAPHS_PER_SHAPE * shapes + 8,
        )
        if not self.threaded:
            return LocalEngine(targets[0], replicas[0], source, self.settings, **common)
        return ThreadedEngine(
            targets,
            replicas,
            source,
            self.settings,
            process=self.process,
            prefetch_depth=cfg.prefetch_depth,
            **common,
        )

    def _total_steps(self) -> int:
        if self.config.steps is not None:
            return self.config.steps
        per_epoch = self.loader.sampler.batches_per_epoch / (self.config.grad_accum * len(self.layout.drafters))
        return max(1, math.ceil(self.config.epochs * per_epoch))

    @property
    def is_main(self) -> bool:
        """Whether this process writes logs and checkpoints (rank 0)."""
        return self.process.is_main

    @property
    def drafter(self) -> torch.nn.Module:
        """Replica 0 of the drafter (what checkpoints save)."""
        return self.engine.drafter

    # ---- the loop -------------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        """Train to ``total_steps``; returns the last step's metrics ({} if there was nothing to do).

        Raises:
            Stopped: a SIGTERM/SIGINT stopped training after a checkpoint was saved (``step`` set).
        """
        from tqdm import tqdm

        cfg = self.config
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / SAVED_CONFIG_NAME).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        log = MetricsLog(
            self.out,
            layout=self.layout,
            total_steps=self.total_steps,
            peak_flops=self.peak_flops,
            start_step=self.step,
            main=self.is_main,
        )
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not (cfg.progress and self.is_main), desc="train")
        metrics: dict[str, float] = {}
        throughput = Throughput()
        first_step = self.step + 1
        if cfg.profile_step and not first_step <= cfg.profile_step <= self.total_steps:
            logger.warning(
                "--profile-step %d is outside this run's steps %d-%d: nothing is profiled",
                cfg.profile_step,
                first_step,
                self.total_steps,
            )
        saving = "saving a checkpoint" if cfg.save else "saving nothing (--no-save)"
        stop = StopRequest(f"finishing this step, {saving}, then exiting")
        started = time.perf_counter()
        if self.compiled:
            warm = compile_cache.load(self.out)
            # The bar stands still meanwhile: say why before it does.
            logger.info(
                "step %d compiles the drafter step (--compile-scope %s)%s",
                first_step,
                cfg.compile_scope,
                ": seconds, from this run's compile artifacts" if warm else ": up to minutes on a cold compile cache",
            )
        if self.heldout is not None and self.step == 0:
            self._measure_acceptance("before step 1", log, started, saved=False)
        try:
            with stop.installed(), log_above_progress_bars(), self.dynamo_warnings:
                while self.step < self.total_steps:
                    self.step += 1
                    with self._stall_watch(), self._profiled():
                        stats = self.engine.run(self.step, lr=self._lr(), stop=stop.requested)
                    if self.step == first_step:
                        self._keep_compile_artifacts()  # the step's compiles are done
                    elif self.step != cfg.profile_step:  # a profiled step runs slower
                        throughput.add(stats)
                    metrics = log.metrics(stats, lr=self._lr())
                    # The step's figures first: update() draws the bar with the postfix it finds.
                    bar.set_postfix(progress_postfix(metrics), refresh=False)
                    bar.update(1)
                    if self._log_due():
                        log.log_step(self.step, metrics, self.engine.interval_report())
                    # Several processes stop together at the step whose gradients carried the
                    # request; one process stops right after the step in flight.
                    if stats.stop or (stop.requested and self.process.world_size == 1):
                        self.save_checkpoint()
                        raise Stopped(stop.signum or signal.SIGTERM, step=self.step)
                    if cfg.save_every and self.step % cfg.save_every == 0:
                        self.save_checkpoint()
                    if self.heldout is not None and self.heldout.due(self.step, self.total_steps):
                        saved = bool(cfg.save and cfg.save_every and self.step % cfg.save_every == 0)
                        self._measure_acceptance(f"at step {self.step}", log, started, saved=saved)
                if not cfg.save_every or self.step % cfg.save_every:
                    self.save_checkpoint()
            if self.heldout is not None and metrics:
                self._measure_acceptance("after the last step", log, started, saved=cfg.save)
        finally:
            bar.close()
            self.engine.close()
            log.close()
            log.log_compile_summary(self.engine.compile_summary())  # also after a failure or a stop: a soak ends so
        log.log_throughput(throughput)
        return metrics

    def _measure_acceptance(self, when: str, log: MetricsLog, started: float, *, saved: bool) -> None:
        """Held-out acceptance of the drafter now (:meth:`HeldOutAcceptance.measure`); rank 0 only."""
        self.heldout.measure(
            self.eval_target, self.drafter, step=self.step, when=when, log=log, started=started, saved=saved
        )

    @property
    def acceptance(self) -> dict[str, float]:
        """Held-out tau per prompt by when it was measured (``dflash train`` prints the first and last)."""
        return self.heldout.measured if self.heldout is not None else {}

    def _keep_compile_artifacts(self) -> None:
        """Rank 0 of a compiled, saving run writes the compile artifacts so far (:mod:`dflash.run.compile_cache`)."""
        if self.compiled and self.is_main and self.config.save:
            compile_cache.save(self.out)

    def _stall_watch(self):
        """A watchdog over one step (:mod:`dflash.watchdog`): a step that makes no progress for
        ``--stall-minutes`` writes every thread's stack to stderr, every as many minutes until it
        moves (a hung compile, collective or queue: the stacks say where)."""
        minutes = self.config.stall_minutes
        return watchdog.watching(60 * minutes, exit=False, repeat=True) if minutes else contextlib.nullcontext()

    def _profiled(self):
        """``--profile-step``: this step under the profiler (:mod:`dflash.profiling`), on the main process."""
        if self.step != self.config.profile_step or not self.is_main:
            return contextlib.nullcontext()
        devices = [slot.device for slot in (*self.layout.targets, *self.layout.drafters)]
        return profiling.profiled_step(self.step, self.out, devices)

    def _lr(self) -> float:
        return learning_rate(self.step, self.config, self.total_steps)

    def _log_due(self) -> bool:
        return self.step % self.config.log_every == 0 or self.step in (1, self.total_steps)

    # ---- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self) -> Path | None:
        """Save the drafter and the exact training state (a collective: every process calls it;
        rank 0 writes). Returns the step directory on rank 0; None elsewhere and with --no-save."""
        if not self.config.save:
            return None
        state = {
            "step": self.step,
            "engine": self.engine.state_dict(),
            "rng": checkpoint.rng_state(),
            "config": self.config.to_dict(),
            "data_sha256": self.corpus.data_sha256,
        }
        if not self.is_main:
            return None
        self._keep_compile_artifacts()
        weights = published_state_dict(self.drafter)
        if weights.keys() != self.drafter.state_dict().keys():  # projected codebooks: resume from the projections
            state[checkpoint.MASTER_WEIGHTS_KEY] = {k: v.detach().cpu() for k, v in self.drafter.state_dict().items()}
        return checkpoint.save_checkpoint(
            self.out,
            self.step,
            weights=weights,
            drafter_config=self.drafter.config.to_diff_dict(),
            training_state=state,
            keep_last=self.config.keep_last,
            dtype=checkpoint.resolve_save_dtype(self.config.save_dtype, self._compute_dtype),
        )

    def _checkpoint_size(self, drafter) -> int:
        export = checkpoint.resolve_save_dtype(self.config.save_dtype, self._compute_dtype)
        parameters = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
        if self.config.selector_codebooks == "projected":  # the tables are exported beside the projections kept
            parameters += 2 * drafter.config.vocab_size * drafter.config.dflash2_value("selector_rank")
        return checkpoint_bytes(parameters, export_itemsize=export.itemsize)

    @property
    def _compute_dtype(self) -> torch.dtype:
        """What the drafter computes in (under CUDA autocast on a GPU)."""
        return compute_dtype(self.layout.drafters[0].device)

    def _layout_words(self) -> str:
        """The device layout for the start's log line: the threaded engine's threads, or the local
        engine's one thread running the target's forward and then the drafter step."""
        if self.threaded:
            targets, drafters = ([s.name for s in slots] for slots in (self.layout.targets, self.layout.drafters))
            return f"target threads {targets}, drafter threads {drafters}"
        target, drafter = self.layout.targets[0].name, self.layout.drafters[0].name
        return f"one thread: the target's forward on {target}, then the drafter step on {drafter}"

    def load_checkpoint(self) -> None:
        """Restore the latest checkpoint in ``out`` for an exact continuation.

        Raises:
            CheckpointError: no/corrupt checkpoint, a different config, a different number of
                processes, or a training state from an older dflash.
        """
        # Verified when the config was settled (dflash.run.preflight.check_out_dir), before the target loaded:
        # hashing a large checkpoint takes seconds, so not again.
        step_dir = find_checkpoint(self.out, verify=False)
        state = checkpoint.load_training_state(step_dir)
        check_resume_config(state["config"], self.config, step_dir)
        data_sha256 = self.corpus.data_sha256
        if state.get("data_sha256", data_sha256) != data_sha256:
            logger.warning(
                "%s: the data file changed since %s was saved (sha256 %.12s -> %.12s): the resumed run draws its "
                "batches from the new contents, so it is not the run it continues",
                self.config.data or "the embedded chat corpus",
                step_dir,
                state["data_sha256"],
                data_sha256,
            )
        engine_state = state.get("engine")
        if engine_state is None:
            raise CheckpointError(
                f"{step_dir} holds a training state of an older dflash version; evaluate it with dflash eval, "
                "or train into a new --out"
            )
        check_process_count(len(engine_state["anchor_rng"]), self.process.world_size, step_dir)
        if self.config.drafter_rows != state["config"].get("drafter_rows") and "drafter_rows" in engine_state:
            engine_state = self._drafter_rows_given(engine_state)
        self.engine.load_state_dict(engine_state, checkpoint.resume_weights(step_dir, state))
        checkpoint.set_rng_state(state["rng"])
        self.step = state["step"]
        logger.info("resumed from %s at step %d (epoch %d)", step_dir, self.step, self.loader.epoch)

    def _drafter_rows_given(self, engine_state: dict) -> dict:
        """``engine_state`` without the saved rows per drafter forward (:mod:`dflash.train.drafter_rows`):
        a ``--drafter-rows`` other than the saved run's, given on resume, wins over them (a warning: the
        saved rows may be fewer because more ran out of memory)."""
        rows = self.config.drafter_rows or self.config.batch_size
        saved = sorted({count for replicas in engine_state["drafter_rows"] for count in replicas})
        if saved != [rows]:
            logger.warning(
                "--drafter-rows %d given on resume: the drafter runs %s per forward, not the %s the saved run's "
                "first step settled on",
                self.config.drafter_rows,
                rows_text(rows),
                " / ".join(rows_text(count) for count in saved),
            )
        return {key: value for key, value in engine_state.items() if key != "drafter_rows"}

    def close(self) -> None:
        """Leave the torchrun process group (call once, after a successful :meth:`train`)."""
        barrier()
        destroy_process_group()


def _warn_if_unpatched(compiled: bool, drafter_threads: int) -> None:
    """Compiling from several threads of one process is what plain torch gets wrong (bug classes A-H):
    warned about when a concern of the series is not covered in this interpreter (the hook off, torch
    imported before it, a patch that failed, an unverified release), not when a rebuilt wheel or an
    upstream fix covers it."""
    if not (compiled and drafter_threads > 1):
        return
    gap = thread_safety_gap()
    if gap is not None:
        logger.warning(
            "the torch thread-safety patches do not cover this interpreter (%s): %d drafter threads compiling in "
            "this process can crash or fall back to eager; `dflash patches status` says why",
            gap,
            drafter_threads,
        )
