"""`dflash export RUN --out DIR`: the run's newest checkpoint as a drafter ready for vLLM, SGLang and
transformers (``trust_remote_code``), with a README of launch lines and measured acceptance
(:mod:`dflash.export`)."""

from __future__ import annotations

import argparse
import logging
import typing

from dflash.commands import COMMON
from dflash.export import README_NAME, ExportDtype, export

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export",
        parents=[COMMON],
        help="write a run's drafter as a serving-ready directory (bf16, README with vLLM/SGLang lines)",
        description="Export the newest checkpoint of a dflash train run (or a step_N directory) as a drafter "
        "directory that vLLM, SGLang and transformers load: config.json, model.safetensors, modeling_dflash.py, "
        "README.md with the launch lines and the acceptance measured for that checkpoint.",
    )
    parser.add_argument("run", help="run directory (--out of dflash train), its checkpoints/ or a step_N directory")
    parser.add_argument(
        "--out", required=True, help="new directory; its name must contain 'dflash' (vLLM detects DFlash by it)"
    )
    parser.add_argument(
        "--dtype",
        choices=typing.get_args(ExportDtype),
        default="bfloat16",
        help="dtype of the exported weights (default: bfloat16)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        out = export(args.run, args.out, dtype=args.dtype)
    except ValueError as e:  # bad input: the message names the problem and the fix
        logger.error("%s", e)
        return 2
    print(f"exported {out} ({args.dtype}); serving lines in {out / README_NAME}")
    return 0
