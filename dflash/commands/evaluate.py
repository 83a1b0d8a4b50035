"""`dflash eval`: speculative decoding of a trained drafter against its target, greedy or sampled.

Prints the acceptance length tau (per step, and per prompt as z-lab's published numbers count
it), its histogram and the speedup over target-only decoding with and without prefill on
held-out prompts (``--json`` for machine-readable output; conventions in :mod:`dflash.evaluation.report`).
``--temperature`` above 0 samples both (with ``--top-p``, ``--top-k``, seeded by ``--seed``) and
verifies drafts by speculative sampling (:mod:`dflash.evaluation.sampling`); each figure then comes
with its 95% interval. Exits 1 when a greedy speculative output differs from the target's greedy
output in float32 (:attr:`dflash.evaluation.report.EvalReport.verification_failed`), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from dflash.assets import default_data_dir, default_target_dir
from dflash.commands import COMMON, positive
from dflash.config import TrainConfig
from dflash.data.chats import DatasetError, prompt_messages, read_conversations, require_data_file
from dflash.devices import check_cpu_threads, compute_dtype, resolve_device, set_cpu_threads
from dflash.drafter.files import DRAFTER_FILES, CheckpointError, check_drafter_fits_target
from dflash.evaluation.sampling_settings import GREEDY, SEED, Sampling
from dflash.files import check_weight_files
from dflash.run import acceptance_log
from dflash.run.layout import SAVED_CONFIG_NAME, read_saved_config, run_of, saved_steps
from dflash.run.lock import training_holder
from dflash.run.step_dirs import find_checkpoint
from dflash.target_model.files import context_length, load_tokenizer, read_target_config, require_transformers_for

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        parents=[COMMON],
        help="measure a drafter: acceptance length tau, histogram, speedup",
        description="Speculative decoding with a DFlash drafter against its target on held-out conversations "
        "(prompt = the conversation up to its first assistant turn): greedy (T=0) by default, sampled with "
        "--temperature.",
    )
    parser.add_argument(
        "--drafter",
        required=True,
        help="run directory of dflash train (--out), its checkpoints/, a step_N directory, or a drafter "
        "shipped for serving (config.json + model.safetensors)",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="local HF target directory (default: the target the run was trained against, "
        "from its train_config.json; else the embedded default target)",
    )
    parser.add_argument(
        "--data",
        default=None,
        help="JSONL chat file of held-out conversations (default: the embedded held-out set, chit-chat); prompts "
        "that do not fit the target's context with --max-new-tokens are skipped",
    )
    parser.add_argument(
        "--num-prompts",
        type=positive(int),
        default=None,
        help="decode a random sample of this many of the held-out set's usable prompts, and give each figure's 95%% "
        "interval (default: all of them)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=SEED,
        help="seed of the --num-prompts sample and, with --temperature, of the sampling (default: %(default)s, as "
        "dflash train's held-out acceptance draws)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=GREEDY.temperature,
        help="0: greedy decoding, each speculative output checked against the target's; above 0: both methods "
        "sample at this temperature and drafts are verified by speculative sampling (lossless: the output is "
        "distributed as the target's own sampling), each figure with its 95%% interval "
        f"(default: {GREEDY.temperature:g})",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=GREEDY.top_p,
        help="with --temperature: sample from the smallest set of most likely tokens whose probability reaches "
        f"this, target and drafter alike (default: {GREEDY.top_p:g}, every token)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=GREEDY.top_k,
        help="with --temperature: sample from the k most likely tokens, target and drafter alike "
        f"(default: {GREEDY.top_k}, every token)",
    )
    parser.add_argument(
        "--random-target-weights",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep random the target weights its files lack, as dflash train does with this flag (a benchmark "
        "of a model's shape: the acceptance then fits no real model) (default: off)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive(int),
        default=TrainConfig.eval_max_new_tokens,
        help="tokens to generate per prompt (default: %(default)s, dflash train's --eval-max-new-tokens)",
    )
    parser.add_argument("--device", default=TrainConfig.device, help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    parser.add_argument(
        "--cpu-threads",
        type=positive(int),
        default=None,
        help="torch intra-op threads on CPU (default: the cores free of other jobs, at least 1, logged; "
        "OMP_NUM_THREADS when set)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        prompts, report, found = _evaluate(args)
    except ValueError as e:  # bad input: the message names the problem and the fix
        logger.error("%s", e)
        return 2
    if found is not None:  # kept with the run: dflash export quotes it
        _record(found[0].parent, Path(args.drafter), prompts, report)
    if args.json:
        held_out = {**prompts.to_dict(), "embedded_default": args.data is None}
        print(json.dumps({**report.to_dict(), "prompts": held_out}, indent=2))
    else:
        _print_prompts(prompts, embedded_default=args.data is None)
        _print_report(report, args.seed)
    # A measurement against a wrongly verified target is no measurement: scripts must see it fail.
    return 1 if report.verification_failed else 0


def _print_prompts(prompts, *, embedded_default: bool) -> None:
    """Which held-out file was evaluated, on which of its prompts, and which of its conversations
    were not (and why)."""
    default = " (the embedded default held-out set: chit-chat; pass --data for your own)" if embedded_default else ""
    which = (
        f"a random sample of {len(prompts.prompts)} of its {prompts.usable} usable prompts (--num-prompts, --seed)"
        if prompts.sampled
        else f"all {len(prompts.prompts)} usable prompts"
    )
    print(f"held-out prompts: {which} from {prompts.source}{default}")
    skipped = []
    if prompts.too_long:
        skipped.append(
            f"{prompts.too_long} longer than {prompts.max_prompt_tokens} tokens (the target's "
            f"max_position_embeddings {prompts.context} minus --max-new-tokens {prompts.max_new_tokens})"
        )
    if prompts.without_prompt:
        skipped.append(
            f"{prompts.without_prompt} without a user turn before an assistant turn (or one the template rejects)"
        )
    if skipped:
        print(f"  skipped conversations: {'; '.join(skipped)}")
    if prompts.requested is not None and len(prompts.prompts) < prompts.requested:
        print(
            f"  fewer than --num-prompts {prompts.requested}: the file has no more usable conversations, "
            "so the figures below rest on fewer prompts"
        )


def _interval(report, name: str, unit: str = "") -> str:
    """`` [low, high] 95%`` of a sampled figure ("" for the whole held-out set)."""
    if name not in report.intervals:
        return ""
    low, high = report.intervals[name]
    return f" [{low:.3f}{unit}, {high:.3f}{unit}] 95%" if not unit else f" [{low:.2f}{unit}, {high:.2f}{unit}] 95%"


def _print_report(report, seed: int) -> None:
    total = sum(report.histogram.values())
    greedy = report.sampling.greedy
    if not greedy:
        print(
            f"sampled at {report.sampling.describe()} (--seed {seed}), target-only and speculative alike: the outputs "
            "are draws of the target's distribution, lossless by the speculative sampling rule, not compared token "
            "for token"
        )
    elif report.mismatches:
        exact = "verification is wrong" if report.verification_failed else "argmax ties, see the warning above"
        print(f"greedy check: {report.mismatches}/{report.num_prompts} outputs differ ({report.dtype}: {exact})")
    else:
        print(f"greedy check: all {report.num_prompts} outputs equal the target's greedy output ({report.dtype})")
    print(
        f"acceptance length tau (block size {report.block_size}, {report.num_prompts} prompts, "
        f"{report.num_tokens} tokens, {total} steps):"
    )
    if report.intervals and greedy:
        print("  (a sample: each figure with its 95% interval over samples of these prompts, percentile bootstrap)")
    elif report.intervals:
        print("  (sampled: each figure with its 95% interval over resamples of the prompts, percentile bootstrap)")
    print(
        f"  {report.tau_per_step:.3f}{_interval(report, 'tau_per_step')} per step   (mean over all steps; last step "
        "cut at EOS/token budget)"
    )
    print(
        f"  {report.tau_per_prompt:.3f}{_interval(report, 'tau_per_prompt')} per prompt (z-lab's published "
        "convention, counted as its dflash_generate at 10129599 counts: mean of per-prompt means, last step cut "
        "at EOS/token budget)"
    )
    print("accepted+1 per step (last step cut):")
    for length in range(1, report.block_size + 1):
        count = report.histogram.get(length, 0)
        share = count / max(total, 1)
        print(f"  {length:3d}: {count:6d} {100 * share:5.1f}% {'#' * round(40 * share)}")
    print(f"speedup over target-only {'greedy decoding' if greedy else 'decoding, sampled alike'}:")
    print(
        f"  {report.speedup:.2f}x{_interval(report, 'speedup', 'x')} with prefill    (target-only "
        f"{report.target_ms_per_token:.2f} ms/token, speculative {report.speculative_ms_per_token:.2f} ms/token; all "
        "tokens / all time)"
    )
    print(
        f"  {report.decode_speedup:.2f}x{_interval(report, 'decode_speedup', 'x')} without prefill (target-only "
        f"{report.target_decode_ms_per_token:.2f} "
        f"ms/token, speculative {report.speculative_decode_ms_per_token:.2f} ms/token; z-lab's convention: "
        "per-prompt decoding time per output token, averaged)"
    )


def _evaluate(args: argparse.Namespace):
    """``(HeldOutPrompts, EvalReport, the run's train_config.json (path, flags) or None)`` of the
    command's arguments. Every flag and path is checked before torch and transformers load (seconds)."""
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if not Path(args.drafter).is_dir():
        what = "a file, not a directory" if Path(args.drafter).exists() else "does not exist"
        raise CheckpointError(
            f"--drafter {args.drafter}: {what}; pass a run directory (--out of dflash "
            "train), a step_N directory or a drafter directory (config.json + model.safetensors)"
        )
    check_cpu_threads(args.cpu_threads)
    run = _run_config(Path(args.drafter))
    _note_training_in_progress(run)
    _refuse_a_run_without_checkpoint(run)
    target_dir = Path(args.target) if args.target else _trained_target(run) or default_target_dir()
    # From the two config.json files and the weight headers, before anything loads (minutes for a large target).
    step_dir = find_checkpoint(args.drafter, verify=False, files=DRAFTER_FILES)
    check_drafter_fits_target(step_dir, target_dir, trained_on=run[1].get("target") if run else None)
    require_transformers_for(read_target_config(target_dir), target_dir / "config.json", decoding=True)
    check_weight_files(target_dir)
    data = require_data_file(_held_out_data(args.data, run))
    from dflash.evaluation.decoding import stop_token_ids
    from dflash.evaluation.measure import evaluate, load_drafter
    from dflash.evaluation.prompts import load_prompts
    from dflash.target_model.model import load_target

    device = resolve_device(args.device)
    set_cpu_threads(args.cpu_threads, device.type)
    dtype = compute_dtype(device)
    # Tokenizer and prompts first: their errors come before the (slow) target loads.
    context = context_length(target_dir)
    tokenizer = load_tokenizer(target_dir)
    prompts = load_prompts(
        tokenizer,
        data,
        num_prompts=args.num_prompts,
        context=context,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    _warn_of_training_prompts(prompts, run)
    drafter = load_drafter(args.drafter, device=device, dtype=dtype)
    target = load_target(
        target_dir,
        layer_ids=drafter.config.target_layer_ids,
        device=device,
        dtype=dtype,
        random_missing=args.random_target_weights,
    )
    report = evaluate(
        target,
        drafter,
        prompts.prompts,
        max_new_tokens=args.max_new_tokens,
        eos_ids=stop_token_ids(tokenizer, target.config),
        sampling=sampling,
        seed=args.seed,
        progress=True,
        sample=prompts.sampled,
    )
    return prompts, report, run


def _record(run_dir: Path, drafter: Path, prompts, report) -> None:
    """Add the measurement to ``run_dir/acceptance.json`` (:mod:`dflash.run.acceptance_log`)."""
    checkpoint = find_checkpoint(drafter, verify=False).name
    try:
        acceptance_log.record(
            run_dir, acceptance_log.entry(report, prompts, checkpoint=checkpoint, source="dflash eval")
        )
    except OSError as e:
        logger.warning("could not keep the result in %s (%s); dflash export will not quote it", run_dir, e)


def _run_config(drafter: Path) -> tuple[Path, dict] | None:
    """``(path, flags)`` of the train_config.json of the run that ``drafter`` (run, checkpoints/ or
    step_N directory) belongs to; None when there is none (a drafter shipped elsewhere).

    Raises:
        ValueError: the run's train_config.json is not valid JSON.
    """
    run = run_of(drafter)
    if run is None or not (run / SAVED_CONFIG_NAME).is_file():
        return None
    return run / SAVED_CONFIG_NAME, read_saved_config(run)


def _note_training_in_progress(found: tuple[Path, dict] | None) -> None:
    """Say so when the run of ``found`` (:func:`_run_config`) is still being trained: its newest
    checkpoint is evaluated, and a later one may follow."""
    holder = training_holder(found[0].parent) if found else None
    if holder is not None:
        logger.warning(
            "%s is still being trained (%s): this evaluates the newest checkpoint saved so far",
            found[0].parent,
            holder.describe(),
        )


def _refuse_a_run_without_checkpoint(found: tuple[Path, dict] | None) -> None:
    """A run directory (or its checkpoints/) with no complete checkpoint yet: say that, not "not a run".

    Raises:
        CheckpointError: the run has saved no checkpoint yet, with when it will.
    """
    if found is None:
        return
    run = found[0].parent
    if saved_steps(run):
        return
    every = found[1].get("save_every")
    when = f"every {every} steps (--save-every) and at its end" if every else "at its end"
    raise CheckpointError(
        f"{run}: no checkpoint saved yet (the run saves one {when}); evaluate it once it has, or pass --drafter with "
        "another run's directory"
    )


def _warn_of_training_prompts(prompts, found: tuple[Path, dict] | None) -> None:
    """Warn when held-out prompts are prompts of the run's training data (tau on them measures what
    the drafter memorised of those replies)."""
    if found is None:
        return
    trained_on = Path(found[1].get("data") or default_data_dir() / "train.jsonl")
    try:
        seen = {_prompt_key(p) for c in read_conversations(trained_on, progress=False) if (p := prompt_messages(c))}
    except DatasetError as e:  # moved or edited since: nothing to compare with
        logger.debug("training data %s not compared with the held-out prompts: %s", trained_on, e)
        return
    overlap = sum(_prompt_key(messages) in seen for messages in prompts.messages)
    if overlap:
        logger.warning(
            "%d of the %d held-out prompts are also prompts of the training data %s: on those, tau measures how well "
            "the drafter remembers replies it was trained on; pass --data with conversations it was not trained on",
            overlap,
            len(prompts.messages),
            trained_on,
        )


def _prompt_key(messages) -> str:
    return json.dumps([[m["role"], m["content"]] for m in messages])


def _trained_target(found: tuple[Path, dict] | None) -> Path | None:
    """The --target of the run of ``found`` (:func:`_run_config`), if recorded."""
    target = found[1].get("target") if found else None
    if target:
        logger.info("target: %s (from %s; pass --target to use another)", target, found[0])
    return Path(target) if target else None


def _held_out_data(data: str | None, found: tuple[Path, dict] | None) -> Path:
    """``--data``, else the embedded held-out set; logged, with a warning when the run of ``found``
    (:func:`_run_config`) was trained on other data than the embedded set."""
    if data:
        logger.info("held-out data: %s", data)
        return Path(data)
    path = default_data_dir() / "heldout.jsonl"
    trained_on = found[1].get("data") if found else None
    if trained_on:
        logger.warning(
            "held-out data: %s, the embedded default (chit-chat), but the drafter was trained on %s "
            "(%s): pass --data with held-out conversations like those",
            path,
            trained_on,
            found[0],
        )
    else:
        logger.info("held-out data: %s (the embedded default held-out set; pass --data for your own)", path)
    return path
