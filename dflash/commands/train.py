"""`dflash train`: train a DFlash drafter for a local Hugging Face target.

Flags are generated from :class:`dflash.config.TrainConfig` (one per field, help = the
field's docstring). With no flags it trains the embedded default target on its chat corpus.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
import shlex
import signal
import sys
import types
import typing
from pathlib import Path

from dflash.commands import COMMON
from dflash.config import PAPER_GAMMA, TrainConfig, field_docs
from dflash.drafter.files import CheckpointError
from dflash.run.drafter_shape import rule_help
from dflash.run.layout import checkpoints_dir, read_saved_config
from dflash.run.lock import check_free, run_lock
from dflash.run.log_file import RunLog
from dflash.run.preflight import refuse_existing_run
from dflash.run.resume import check_given_flags, resumed_values
from dflash.run.settle import settle
from dflash.run.step_dirs import find_checkpoint
from dflash.signals import Stopped

logger = logging.getLogger(__name__)


def _optional_int_list(text: str) -> list[int] | None:
    return None if text == "" else [int(x) for x in text.replace(",", " ").split()]


_optional_int_list.__name__ = "comma-separated integer list"  # argparse names it in "invalid ... value"


class _OptionalChoices(tuple):
    """An optional choice field's choices: the empty string (converted to None) is one too, unlisted."""

    def __contains__(self, value) -> bool:
        return value is None or super().__contains__(value)


def _add_field(parser: argparse.ArgumentParser, f: dataclasses.Field, hints: dict, docs: dict) -> None:
    flag = "--" + f.name.replace("_", "-")
    hint = hints[f.name]
    args = typing.get_args(hint)
    optional = type(None) in args
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)  # Literal[...] | None is a typing.Union
    base = next((a for a in args if a is not type(None)), hint) if union else hint
    help_text = docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %
    if base is bool:
        parser.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=argparse.SUPPRESS,
            help=f"{help_text} (default: {f.default})",
        )
        return
    choices = typing.get_args(base) if typing.get_origin(base) is typing.Literal else None
    if choices:
        # Choices from the field's Literal (dflash.choices); an empty string means None, "the rule".
        convert, metavar = (lambda text: text or None) if optional else str, "{" + ",".join(choices) + "}"
        choices = _OptionalChoices(choices) if optional else choices
    elif typing.get_origin(base) is list:
        convert, metavar = _optional_int_list, "IDS"
    else:
        convert, metavar = base, f.name.upper()
        if optional:  # an empty string means None ("use the default rule")
            convert = lambda text, base=base: None if text == "" else base(text)
            convert.__name__ = base.__name__  # argparse names it in "invalid int value: 'abc'"
    default = f.default if f.default is not dataclasses.MISSING else None
    shown = default if default is not None else _empty_means(f.name)
    parser.add_argument(
        flag,
        type=convert,
        choices=choices,
        metavar=metavar,
        default=argparse.SUPPRESS,
        help=f"{help_text} (default: {shown})",
    )


def _empty_means(name: str) -> str:
    """What an empty field becomes, for --help, from the values the run itself reads."""
    if name == "gamma":
        return "empty: the DFlash paper's for the block size, " + ", ".join(
            f"{gamma:g} for {block}" for block, gamma in PAPER_GAMMA.items()
        )
    rule = rule_help(name)
    return f"empty: {rule}" if rule else "empty"


def _saved_config(out: str) -> dict:
    """The flags of the run in ``out`` (its train_config.json), less where it lives; {} if none."""
    return {k: v for k, v in read_saved_config(out).items() if k not in ("out", "resume")}


def _config_from_flags(values: dict):
    """``TrainConfig.from_dict``, its errors naming flags (``--keep-last``) instead of fields.

    Raises:
        ValueError: a value the config rejects.
    """
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        return TrainConfig.from_dict(values)
    except ValueError as e:
        message = re.sub(
            r"^[a-z_]+(?:/[a-z_]+)*",
            lambda m: "/".join("--" + n.replace("_", "-") if n in fields else n for n in m.group().split("/")),
            str(e),
        )
        raise ValueError(message) from None


def _already_done(config) -> bool:
    """Whether the run to resume already has its ``--steps`` (said once, before anything loads)."""
    step = int(find_checkpoint(config.out, verify=False).name.removeprefix("step_"))
    if config.steps is None or step < config.steps:
        return False
    if int(os.environ.get("RANK", 0)) == 0:
        print(
            f"nothing to train: {config.out} is already at step {step} of {config.steps} "
            "(pass a larger --steps to continue)"
        )
    return True


def _resumed_values(given: dict) -> dict:
    """The flags of a resumed run (:func:`dflash.run.resume.resumed_values`), those ``given`` checked
    first against the saved run's (:func:`dflash.run.resume.check_given_flags`).

    Raises:
        CheckpointError: a flag given now changes the math of the saved run.
    """
    out = given.get("out", TrainConfig.out)
    saved = _saved_config(out)
    if saved:
        check_given_flags(saved, given, Path(out))
    return resumed_values(saved, given)


@contextlib.contextmanager
def _out_lock(config, run_log: RunLog):
    """One training per ``--out``: rank 0 holds its lock from before the first write (replies
    regenerated into it) to the end, checks again under the lock that no other run got there
    first (:mod:`dflash.run.lock`), and from then on appends its log to the run's log file."""
    if int(os.environ.get("RANK", 0)) != 0:
        yield
        return
    with run_lock(config.out):
        refuse_existing_run(Path(config.out), resume=config.resume)
        run_log.write_to(config.out)
        yield


def _resume_hint(out: str, what: str) -> None:
    """After a stop: how to go on (once per job, from rank 0)."""
    if int(os.environ.get("RANK", 0)) != 0:
        return
    try:
        find_checkpoint(out, verify=False)
        saved = True
    except CheckpointError:
        saved = False
    if saved:
        # Checkpoints are written atomically, so the newest one on disk is complete.
        logger.error(
            "%s; the checkpoints in %s are intact: continue with `dflash train --resume --out %s`",
            what,
            out,
            shlex.quote(out),
        )
    else:
        logger.error("%s before the first checkpoint: nothing to --resume in %s; start the run again", what, out)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        parents=[COMMON],
        help="train a DFlash drafter (no flags: the embedded default target)",
        description="Train a DFlash drafter against a frozen target. With no flags, trains the embedded "
        "default target on its chat corpus on this machine's CPU (or GPU with --device cuda).",
    )
    hints = typing.get_type_hints(TrainConfig)
    docs = field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        _add_field(parser, f, hints, docs)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    run_log = RunLog()  # from here: what settling the flags says goes into the run's log file too
    try:
        return _train(args, run_log)
    finally:
        run_log.close()


def _train(args: argparse.Namespace, run_log: RunLog) -> int:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)}
    if "epochs" in values and "steps" not in values:
        values["steps"] = None  # --epochs alone means "train by epochs"
    trainer = None
    try:
        if int(os.environ.get("RANK", 0)) == 0:  # another training in --out: said first, in a second
            check_free(values.get("out", TrainConfig.out))
        if values.get("resume"):
            values = _resumed_values(values)
        config = settle(_config_from_flags(values))  # once, before torch-heavy imports
        if config.resume and _already_done(config):
            return 0
        with _out_lock(config, run_log):
            from dflash.train.trainer import Trainer  # torch, transformers: seconds, under the lock

            trainer = Trainer(config)
            metrics = trainer.train()
        trainer.close()  # not after a failure: the other ranks may be inside a collective
    except ValueError as e:  # bad input: the message names the problem and the fix
        logger.error("%s", e)
        return 2
    except Stopped as stopped:  # it said what it kept; training saved a checkpoint after its last step
        if stopped.step is not None and config.save:
            _resume_hint(config.out, f"{stopped}, checkpoint saved")
        elif stopped.step is not None:
            logger.error("%s; nothing was saved (--no-save)", stopped)
        return 128 + stopped.signum
    except KeyboardInterrupt:
        _resume_hint(values.get("out", TrainConfig.out), "interrupted")
        return 128 + signal.SIGINT
    except Exception as error:
        if "torch" not in sys.modules:
            raise
        from dflash.run.out_of_memory import advice, out_of_memory_error

        if out_of_memory_error(error) is None:
            raise
        logger.debug("out of memory", exc_info=error)  # where it ran out, for --verbose
        logger.error("%s", advice(config, error, trainer.step if trainer is not None and trainer.step else None))
        return 1
    if not trainer.is_main:  # rank 0 speaks for the job
        return 0
    if not metrics:
        print(
            f"nothing to train: {trainer.out} is already at step {trainer.step} of {trainer.total_steps} "
            "(pass a larger --steps to continue)"
        )
        return 0
    saved = (
        f"drafter saved in {checkpoints_dir(trainer.out)} (evaluate with: dflash eval --drafter "
        f"{shlex.quote(str(trainer.out))})"
        if trainer.config.save
        else "nothing saved (--no-save)"
    )
    ends = dict(list(trainer.acceptance.items())[:1] + list(trainer.acceptance.items())[-1:])  # the rest: metrics.jsonl
    measured = "".join(f"; held-out tau {tau:.3f} {when}" for when, tau in ends.items())
    summary = (
        f"trained {trainer.step} steps: loss {metrics['loss']:.4f}, tau_hat {metrics['tau_hat']:.3f}{measured}; {saved}"
    )
    print(summary)
    run_log.note(summary)
    return 0
