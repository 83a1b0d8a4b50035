"""The ``dflash`` console command: ``dflash train``, ``dflash eval``, ``dflash patches ...``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from dflash import __version__
from dflash.progress_logging import log_above_progress_bars, output_may_close

# Modules under dflash.commands, in the order their subcommands are listed in --help.
_COMMANDS = ("train", "evaluate", "export", "patches")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash",
        description="Train and evaluate DFlash speculative-decoding drafters on thread-safe torch.compile.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"dflash {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(f"dflash.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with output_may_close():
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
        )
        # -v: this package's debug lines only (the libraries' would bury them: file locks, HTTP, ...).
        logging.getLogger("dflash").setLevel(logging.DEBUG if args.verbose else logging.NOTSET)
        with log_above_progress_bars():
            return int(args.func(args) or 0)
