"""What ``dflash eval`` and the trainer's held-out measurement run: a drafter loaded from a run
or a shipped directory, decoded against its target beside target-only decoding on the same
prompts, greedily or sampled, summarised as an :class:`dflash.evaluation.report.EvalReport`."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash.drafter.files import DRAFTER_FILES
from dflash.drafter.model import architecture_name, load_drafter_dir
from dflash.evaluation.decoding import speculative_generate, target_generate
from dflash.evaluation.report import EvalReport, bootstrap_intervals, summarize
from dflash.evaluation.sampling import Decoder
from dflash.evaluation.sampling_settings import Sampling
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
    sampling: Sampling,
    seed: int,
    progress: bool,
    sample: bool,
) -> EvalReport:
    """Run target-only and speculative decoding on every prompt, both choosing tokens by
    ``sampling``, and compare.

    The first prompt is run once untimed by both methods as a warm-up. Greedy, each speculative
    output is checked against the target-only one and the report counts the mismatches
    (:attr:`EvalReport.verification_failed` in float32, where verification must be exact; a
    warning in bf16, where the batched verify forward and one-token decoding round differently and
    can break argmax ties). Sampled, the two outputs of a prompt are independent draws (each
    generation has its own stream, seeded from ``seed``, the prompt and the method), so none is
    compared, and the report gets the 95% interval of each figure over the prompts. ``sample``:
    the prompts are a random sample of the held-out set, and the report gets the intervals too.
    """
    from tqdm import tqdm

    kwargs = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    decoder = lambda prompt, method: Decoder(sampling, _generator(sampling, seed, prompt, method, target.device))
    target_generate(target, prompts[0], decoder=decoder(-1, 0), **kwargs)
    speculative_generate(target, drafter, prompts[0], decoder=decoder(-1, 1), rollback_strategy="mixers", **kwargs)
    plains, specs = [], []
    for index, prompt in enumerate(tqdm(prompts, desc="eval", disable=not progress)):
        plains.append(target_generate(target, prompt, decoder=decoder(index, 0), **kwargs))
        specs.append(
            speculative_generate(
                target, drafter, prompt, decoder=decoder(index, 1), rollback_strategy="mixers", **kwargs
            )
        )
    report = summarize(plains, specs, block_size=drafter.config.block_size, dtype=target.dtype, sampling=sampling)
    if sampling.greedy:
        _check_exactness(report)
    if sample or not sampling.greedy:
        report.intervals = bootstrap_intervals(plains, specs)
    return report


def _generator(sampling: Sampling, seed: int, prompt: int, method: int, device: torch.device):
    """The random stream of one generation (None when greedy): method 0 is target-only, 1 speculative."""
    if sampling.greedy:
        return None
    return torch.Generator(device).manual_seed(((seed * 1_000_003) + prompt + 1) * 2 + method)


def _check_exactness(report: EvalReport) -> None:
    if report.verification_failed:
        logger.error(
            "%d/%d speculative outputs differ from the target's greedy output in float32: verification is wrong, so "
            "is the acceptance measured; please report it",
            report.mismatches,
            report.num_prompts,
        )
    elif report.mismatches:
        logger.warning(
            "%d/%d speculative outputs differ from the target's greedy output: in %s the batched verify forward and "
            "one-token decoding round differently and can break argmax ties; rerun with float32 to check exactness",
            report.mismatches,
            report.num_prompts,
            report.dtype,
        )
