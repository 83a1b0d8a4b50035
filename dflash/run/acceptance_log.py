"""Held-out acceptance measured for a run, kept beside its checkpoints in ``<run>/acceptance.json``.

Written by ``dflash eval`` (when the drafter it evaluates belongs to a run) and by ``dflash train
--init-from`` (the starting drafter before step 1, the fine-tuned one after the last step); read by
``dflash export`` for the README it writes. One JSON object, ``{"measurements": [entry, ...]}``,
oldest first; an entry is :func:`entry` (the :class:`dflash.evaluation.report.EvalReport` fields plus what
was measured, on what and by whom).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dflash.files import atomic_write_bytes
from dflash.run.layout import ACCEPTANCE_NAME

logger = logging.getLogger(__name__)


def entry(report, prompts, *, checkpoint: str | None, source: str) -> dict:
    """One measurement.

    Args:
        report (EvalReport): what :func:`dflash.evaluation.measure.evaluate` returned.
        prompts (HeldOutPrompts): the held-out prompts it decoded.
        checkpoint (str, optional): the step directory's name (``step_00000300``); None for a
            drafter that is not a checkpoint of the run (the ``--init-from`` starting point).
        source (str): who measured it, e.g. ``"dflash eval"``.
    """
    return {
        "source": source,
        "checkpoint": checkpoint,
        "data": str(prompts.source),
        "max_new_tokens": prompts.max_new_tokens,
        **report.to_dict(),
    }


def record(run_dir: str | Path, measurement: dict) -> None:
    """Append ``measurement`` to ``run_dir/acceptance.json`` (written atomically)."""
    path = Path(run_dir) / ACCEPTANCE_NAME
    log = read(run_dir)
    log.append(measurement)
    atomic_write_bytes(path, (json.dumps({"measurements": log}, indent=2) + "\n").encode())


def read(run_dir: str | Path) -> list[dict]:
    """The measurements of ``run_dir``, oldest first; [] when there is none (a warning when the
    file cannot be read: the next :func:`record` starts it again)."""
    path = Path(run_dir) / ACCEPTANCE_NAME
    if not path.exists():
        return []
    try:
        return list(json.loads(path.read_text())["measurements"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("%s: unreadable (%s); its measurements are ignored", path, e)
        return []


def most_complete_for(run_dir: str | Path, checkpoint: str) -> dict | None:
    """The measurement of the checkpoint named ``checkpoint`` that rests on the most prompts (then the
    most tokens; the newest of equals), greedy ones first, or None: a 20-prompt sample measured last
    is not what the whole held-out set measured before it, and tau is published greedy (a measurement
    at temperature 1 is another figure, not a more complete one)."""
    measured = [m for m in read(run_dir) if m.get("checkpoint") == checkpoint]
    if not measured:
        return None
    return max(
        reversed(measured),
        key=lambda m: (m.get("decoding", "greedy") == "greedy", m.get("num_prompts", 0), m.get("num_tokens", 0)),
    )
