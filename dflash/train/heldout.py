"""Held-out acceptance during a run (``--eval-data``, or ``--init-from``'s before and after): tau as
``dflash eval`` measures it (:func:`dflash.evaluation.measure.evaluate`: real speculative decoding
against the run's target, greedy or sampled at ``--eval-temperature``), before step 1, every
``--eval-every`` steps and after the last step, into the log, TensorBoard and ``metrics.jsonl``
(``heldout/*``; step 0 before step 1) and the run's ``acceptance.json``
(:mod:`dflash.run.acceptance_log`, which ``dflash export`` quotes). Training waits while it runs;
rank 0 measures, the other processes wait at their next collective.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from dflash.assets import default_data_dir
from dflash.config import TrainConfig
from dflash.drafter.codebooks import published_state_dict
from dflash.drafter.model import AnchoredDrafter
from dflash.evaluation.decoding import stop_token_ids
from dflash.evaluation.measure import evaluate
from dflash.evaluation.prompts import load_prompts
from dflash.evaluation.sampling_settings import GREEDY, SEED
from dflash.run import acceptance_log
from dflash.run.layout import step_dir_name
from dflash.target_model.files import context_length
from dflash.train.metrics import MetricsLog

logger = logging.getLogger(__name__)


class HeldOutAcceptance:
    """The held-out prompts of a run, read before the target loads, and its measurements.

    Args:
        config (TrainConfig): ``eval_data`` (empty: the embedded held-out set), ``eval_prompts``,
            ``eval_max_new_tokens``, ``eval_temperature``, ``eval_every``, ``init_from``,
            ``target_dtype``, ``out``.
        tokenizer: the target's.
        target_dir (Path): the target's directory (its context length bounds the prompts).

    Raises:
        DatasetError: no usable held-out prompt (names the file and the fix).
    """

    def __init__(self, config: TrainConfig, tokenizer, target_dir: Path) -> None:
        self.config, self.tokenizer = config, tokenizer
        path = Path(config.eval_data) if config.eval_data else default_data_dir() / "heldout.jsonl"
        self.prompts = load_prompts(
            tokenizer,
            path,
            num_prompts=config.eval_prompts,
            context=context_length(target_dir),
            max_new_tokens=config.eval_max_new_tokens,
            seed=SEED,
        )
        #: tau per prompt (z-lab's convention) by when it was measured ("before step 1", ...).
        self.measured: dict[str, float] = {}

    def due(self, step: int, total_steps: int) -> bool:
        """Whether ``--eval-every`` asks for a measurement after ``step`` (the last step's follows the loop)."""
        every = self.config.eval_every
        return bool(every) and step % every == 0 and step < total_steps

    def measure(self, target, drafter, *, step: int, when: str, log: MetricsLog, started: float, saved: bool) -> None:
        """Held-out acceptance of ``drafter`` now, on a copy in ``target``'s dtype and on its device,
        logged with its cost (``started``: the run's start, ``time.perf_counter``), recorded at
        ``step`` and kept in ``acceptance.json`` (for ``step``'s checkpoint when ``saved``)."""
        began = time.perf_counter()
        with torch.random.fork_rng(devices=[]):  # building the copy must not move the training RNG
            copy = AnchoredDrafter._from_config(drafter.config, attn_implementation="sdpa", dtype=target.dtype)
        copy.load_state_dict(published_state_dict(drafter))
        report = evaluate(
            target,
            copy.to(target.device).eval(),
            self.prompts.prompts,
            max_new_tokens=self.prompts.max_new_tokens,
            eos_ids=stop_token_ids(self.tokenizer, target.config),
            sampling=dataclasses.replace(GREEDY, temperature=self.config.eval_temperature),
            seed=SEED,
            progress=False,
            sample=False,
        )
        seconds = time.perf_counter() - began
        against = " against the FP8 target" if self.config.target_dtype == "fp8" else ""
        sampled = "" if report.sampling.greedy else f", sampled at {report.sampling.describe()}"
        logger.info(
            "held-out acceptance %s%s%s: tau %.3f per prompt (z-lab's convention), %.3f per step, on %d prompts of %s "
            "(%.1f s, %.0f%% of the run's time so far)",
            when,
            against,
            sampled,
            report.tau_per_prompt,
            report.tau_per_step,
            report.num_prompts,
            self.prompts.source,
            seconds,
            100 * seconds / max(time.perf_counter() - started, 1e-9),
        )
        self.measured[when] = report.tau_per_prompt
        figures = {
            "heldout/tau_per_prompt": report.tau_per_prompt,
            "heldout/tau_per_step": report.tau_per_step,
            "heldout/seconds": seconds,
        }
        if report.mismatches is not None:  # greedy: the exactness check
            figures["heldout/mismatches"] = report.mismatches
        log.record(step, figures)
        origin = f" --init-from {self.config.init_from}" if self.config.init_from else ""
        acceptance_log.record(
            self.config.out,
            acceptance_log.entry(
                report,
                self.prompts,
                checkpoint=step_dir_name(step) if saved else None,
                source=f"dflash train{origin}{against}{sampled} ({when})",
            ),
        )
