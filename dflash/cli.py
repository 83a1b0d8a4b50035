"""The ``dflash`` console command: ``dflash train``, ``dflash eval``, ``dflash patches ...``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from dflash import __version__
from dflash.progress_logging import LOG_FORMAT, log_above_progress_bars, output_may_close

# Modules under dflash.commands, in the order their subcommands are listed in --help.
_COMMANDS = ("train", "evaluate", "export", "patches")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash",
        description="Train and evaluate DFlash speculative-decoding drafters on thread-safe torch.compile.",
        allow_abbrev=False,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"dflash {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(f"dflash.commands.{name}").register(subparsers)
    _set_up_each_command(parser)
    return parser


def _set_up_each_command(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command parser under ``parser`` puts itself into the namespace it parses (the
    innermost one is last, so it wins) and takes whole flags only (a prefix is unknown and named with
    the flag it likely meant, never bound to whichever flag it begins)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                command.set_defaults(command_parser=command)
                command.allow_abbrev = False
                _set_up_each_command(command)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line's arguments; a flag the command does not know is named by that command's
    usage (not the top-level one), with the flag it most likely meant."""
    import difflib

    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        command = args.command_parser
        flags = [flag for flag in command._option_string_actions if flag.startswith("--")]
        close = difflib.get_close_matches(unknown[0].split("=")[0], flags, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    with output_may_close():
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
        # -v: this package's debug lines only (the libraries' would bury them: file locks, HTTP, ...).
        logging.getLogger("dflash").setLevel(logging.DEBUG if args.verbose else logging.NOTSET)
        with log_above_progress_bars():
            return int(args.func(args) or 0)
