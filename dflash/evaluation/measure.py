"""What ``dflash eval`` and the trainer's held-out measurement run: a drafter loaded from a run
or a shipped directory, decoded against its target with target-only decoding on the same
prompts, summarised as an :class:`dflash.evaluation.report.EvalReport`."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash.drafter.files import DRAFTER_FILES
from dflash.drafter.model import architecture_name, load_drafter_dir
from dflash.evaluation.decoding import greedy_generate, speculative_generate
from dflash.evaluation.report import EvalReport, bootstrap_intervals, summarize
from dflash.run.step_dirs import find_checkpoint
from dflash.target_model.model import Target

logger = logging.getLogger(__name__)


def load_drafter(path: str | Path, *, device: torch.device, dtype: torch.dtype):
    """Load a drafter from a run directory, its ``checkpoints/``, a step directory or a drafter
    shipped for serving (``config.json`` and ``model.safetensors`` are all it reads: no training
    state needed), in ``dtype`` on ``device``, with SDPA attention. The two files are verified
    against the manifest when there is one; without it a warning says they were not. Loaded
    strictly (:mod:`dflash.drafter.files`): never a random weight, never a default shape.

    Raises:
        CheckpointError: see :func:`dflash.run.step_dirs.find_checkpoint`; a config that is not a
            drafter's or lacks a field, or weights that disagree with it (named), before any
            model is built.
    """
    step_dir = find_checkpoint(path, files=DRAFTER_FILES)
    drafter = load_drafter_dir(step_dir, dtype=dtype, device=device)
    logger.info(
        "drafter %s: %s, %d layer(s) (%s), block size %d, taps target layers %s",
        step_dir,
        architecture_name(drafter.config),
        drafter.config.num_hidden_layers,
        ", ".join(drafter.config.layer_types),
        drafter.config.block_size,
        drafter.config.target_layer_ids,
    )
    return drafter.eval()


def evaluate(
    target: Target,
    drafter,
    prompts: list[torch.Tensor],
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    progress: bool = False,
    sample: bool = False,
) -> EvalReport:
    """Run target-only greedy and speculative decoding on every prompt and compare.

    The first prompt is run once untimed by both methods as a warm-up. Each speculative output
    is checked against the greedy one and the report counts the mismatches
    (:attr:`EvalReport.verification_failed` in float32, where verification must be exact; a
    warning in bf16, where the batched verify forward and one-token decoding round differently and
    can break argmax ties). ``sample``: the prompts are a random sample of the held-out set, and
    the report gets the 95% interval of each figure.
    """
    from tqdm import tqdm

    kwargs = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    greedy_generate(target, prompts[0], **kwargs)
    speculative_generate(target, drafter, prompts[0], **kwargs)
    plains, specs = [], []
    for prompt in tqdm(prompts, desc="eval", disable=not progress):
        plains.append(greedy_generate(target, prompt, **kwargs))
        specs.append(speculative_generate(target, drafter, prompt, **kwargs))
    report = summarize(plains, specs, block_size=drafter.config.block_size, dtype=target.dtype)
    if report.verification_failed:
        logger.error(
            "%d/%d speculative outputs differ from the target's greedy output in float32: verification is wrong, so "
            "is the acceptance measured; please report it",
            report.mismatches,
            len(prompts),
        )
    elif report.mismatches:
        logger.warning(
            "%d/%d speculative outputs differ from the target's greedy output: in %s the batched verify forward and "
            "one-token decoding round differently and can break argmax ties; rerun with float32 to check exactness",
            report.mismatches,
            len(prompts),
            report.dtype,
        )
    if sample:
        report.intervals = bootstrap_intervals(plains, specs)
    return report
