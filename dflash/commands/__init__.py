"""Subcommands of the ``dflash`` console command, one module each: :mod:`~dflash.commands.train`,
:mod:`~dflash.commands.evaluate` (``dflash eval``), :mod:`~dflash.commands.export` and
:mod:`~dflash.commands.patches`.

Each module exposes ``register(subparsers)``, which adds its parser (with
``parents=[COMMON]``) and sets ``func`` to a callable taking the parsed
``argparse.Namespace`` and returning an exit code. Heavy imports (torch,
transformers) happen inside ``func`` so that ``dflash --help`` stays instant.
"""

import argparse
import math

# Options every (sub)command takes, so `dflash train -v` works as well as `dflash -v train`.
# SUPPRESS: a subcommand that is not given -v leaves the value the main parser set.
COMMON = argparse.ArgumentParser(add_help=False)
COMMON.add_argument(
    "-v",
    "--verbose",
    action="store_true",
    default=argparse.SUPPRESS,
    help="log dflash's DEBUG lines too",
)


def positive(kind):
    """argparse ``type`` of a finite number > 0 of ``kind`` (int or float): a clear usage error
    (``must be a finite number > 0``) instead of a traceback deep in torch."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
        return value

    return parse
