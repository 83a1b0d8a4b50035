"""A run directory (``dflash train --out``): the one place the names of what a run writes there are
written, where its step directories are and which run a directory belongs to, and which directories
may be one.

A run's directory::

    train_config.json           the run's flags (read back by --resume, dflash eval and dflash export)
    train.log                   its log lines, every start and resume appended (:mod:`dflash.run.log_file`)
    checkpoints/step_00000300/  a step directory (:mod:`dflash.run.step_dirs`: its files, verified)
    checkpoints/latest          the name of the newest complete step directory
    tensorboard/, metrics.jsonl the logged figures
    train.lock                  held while a training runs (:mod:`dflash.run.lock`)
    regenerated_train.jsonl     the target's replies, with their key (.key.json) and journals (.partial)
    tokenized/                  the token cache (:mod:`dflash.data.token_cache`)
    acceptance.json             held-out acceptance measured for it (:mod:`dflash.run.acceptance_log`)
    compile_cache.bin, triton_autotune.json   compile artifacts (:mod:`dflash.run.compile_cache`)

``--out`` must name a directory that is not inside another run (``<run>/checkpoints`` would nest a
run among another's checkpoints, and ``dflash eval --drafter <run>`` would pick the nested one), and
that holds nothing else unless ``--allow-nonempty-out`` says so (``--out ~`` would spread a run's
files among the user's). An empty ``--out`` is refused when the config is built.

Free of torch: the CLI reads a run's flags and finds its checkpoints before anything heavy loads.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

#: The run's flags, written by the trainer; read back by --resume, dflash eval and dflash export.
SAVED_CONFIG_NAME = "train_config.json"
#: The run's log lines (:mod:`dflash.run.log_file`).
LOG_NAME = "train.log"
CHECKPOINTS_DIR = "checkpoints"
#: In ``checkpoints/``: the name of the newest complete step directory.
LATEST_NAME = "latest"
#: In a step directory: the size and sha256 of each of its files (written last).
MANIFEST_NAME = "manifest.json"
TENSORBOARD_DIR = "tensorboard"
#: One JSON object per logged step (rank 0), beside the tensorboard logs.
METRICS_NAME = "metrics.jsonl"
#: Held while a training runs.
LOCK_NAME = "train.lock"
#: The target-regenerated corpus; its key (``.key.json``) and journals (``.partial``) start with this name.
REGENERATED_NAME = "regenerated_train.jsonl"
#: The token cache (:mod:`dflash.data.token_cache`).
TOKENS_DIR = "tokenized"
#: Held-out acceptance measured for the run (:mod:`dflash.run.acceptance_log`).
ACCEPTANCE_NAME = "acceptance.json"
#: The compile artifacts (:mod:`dflash.run.compile_cache`).
COMPILE_CACHE_NAME = "compile_cache.bin"
#: Triton's autotune results of kernels run outside the compiled step (:mod:`dflash.run.compile_cache`).
AUTOTUNE_NAME = "triton_autotune.json"
_RUN_FILES = {
    SAVED_CONFIG_NAME,
    LOG_NAME,
    CHECKPOINTS_DIR,
    TENSORBOARD_DIR,
    METRICS_NAME,
    LOCK_NAME,
    TOKENS_DIR,
    ACCEPTANCE_NAME,
    COMPILE_CACHE_NAME,
    AUTOTUNE_NAME,
}
#: A complete step directory's name; a save writes ``step_N.tmp`` and renames it once it is whole.
_STEP_DIR = re.compile(r"step_\d+")


def step_dir_name(step: int) -> str:
    """Name of the step directory of ``step`` under ``checkpoints/`` (``step_00000300``)."""
    return f"step_{step:08d}"


def checkpoints_dir(run: str | os.PathLike) -> Path:
    """``run``'s ``checkpoints/``."""
    return Path(run) / CHECKPOINTS_DIR


def step_dirs(checkpoints: Path) -> list[Path]:
    """The complete step directories in ``checkpoints`` (a run's ``checkpoints/``), oldest first;
    never a half-written ``step_N.tmp``; [] when there is no such directory."""
    if not checkpoints.is_dir():
        return []
    return sorted(p for p in checkpoints.iterdir() if _STEP_DIR.fullmatch(p.name) and p.is_dir())


def saved_steps(run: str | os.PathLike) -> list[Path]:
    """The complete step directories of the run in ``run``, oldest first ([] before its first save)."""
    return step_dirs(checkpoints_dir(run))


def is_run_file(name: str) -> bool:
    """Whether a name in ``--out`` is one a run writes (hidden names, such as atomic writes' temp
    files, count as a run's)."""
    return name in _RUN_FILES or name.startswith((REGENERATED_NAME, "."))


def holds_run(path: Path) -> bool:
    """Whether ``path`` is a run's directory: its flags, or a checkpoint, are there."""
    return (path / SAVED_CONFIG_NAME).is_file() or bool(saved_steps(path))


def run_of(path: str | os.PathLike) -> Path | None:
    """The run directory ``path`` is, or belongs to: ``path`` itself, the run of its ``checkpoints/``,
    or the run of one of its step directories; None for a directory of no run (a drafter shipped
    elsewhere)."""
    path = Path(path)
    candidates = [path]
    if path.name == CHECKPOINTS_DIR:
        candidates.append(path.parent)
    if path.parent.name == CHECKPOINTS_DIR:
        candidates.append(path.parent.parent)
    return next((c for c in candidates if holds_run(c)), None)


def read_saved_config(run_dir: str | os.PathLike) -> dict:
    """The flags saved in ``run_dir/train_config.json``; {} if there is none.

    Raises:
        ValueError: the file is not valid JSON (the message names it).
    """
    path = Path(run_dir) / SAVED_CONFIG_NAME
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); fix or delete it, or pass the flags explicitly") from None


def check_out_location(out: Path, *, allow_nonempty: bool) -> None:
    """``out`` is not inside another run, and holds only a run's files unless ``allow_nonempty``.

    Raises:
        ValueError: the run ``out`` is inside, or the first other files ``out`` holds; each with the fix.
    """
    resolved = out.expanduser().resolve()
    enclosing = next((parent for parent in resolved.parents if holds_run(parent)), None)
    if enclosing is not None:
        raise ValueError(
            f"--out {out} is inside the run {enclosing}: a run there would nest among its files (and dflash eval "
            f"--drafter {enclosing} would pick it); choose a directory outside it, e.g. --out "
            f"{enclosing.parent / (enclosing.name + '-2')}"
        )
    others = sorted(p.name for p in resolved.iterdir() if not is_run_file(p.name)) if resolved.is_dir() else []
    if others and not allow_nonempty:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ValueError(
            f"--out {out} already holds files that are not a run's ({shown}); choose an empty or new directory, "
            "or pass --allow-nonempty-out to add the run's files beside them"
        )


#: What a checkpoint holds besides the tensors: config.json, manifest.json, modeling_dflash.py, the
#: RNG and data-order state and the tensor headers (77 KB on a tiny run, 2026-12-04).
CHECKPOINT_OVERHEAD = 128 * 1024


def checkpoint_bytes(parameters: int, *, export_itemsize: int) -> int:
    """About the size of one checkpoint of a drafter of ``parameters`` trainable parameters
    (:mod:`dflash.run.checkpoint`): the exported weights, AdamW's two float32 moments, the float32 master
    weights when the export is narrower, and :data:`CHECKPOINT_OVERHEAD`."""
    master = 4 if export_itemsize < 4 else 0
    return parameters * (export_itemsize + 8 + master) + CHECKPOINT_OVERHEAD


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_free_space(out: Path, *, checkpoint_size: int, keep_last: int) -> None:
    """The disk of ``out`` holds the next checkpoint (written before the oldest is pruned); a
    warning says when it will not hold ``keep_last`` of them plus the one being written.

    Raises:
        ValueError: not even the next checkpoint fits; names the sizes and the fixes.
    """
    existing = len(saved_steps(out))
    free = shutil.disk_usage(next(p for p in (out, *out.resolve().parents) if p.exists())).free
    fixes = "free space, choose another --out, save narrower weights (--save-dtype bfloat16) or train with --no-save"
    if free < checkpoint_size:
        raise ValueError(
            f"--out {out}: {_size(free)} free, but a checkpoint of this run takes about {_size(checkpoint_size)}: the "
            f"first save would fail and the steps before it be lost; {fixes}"
        )
    needed = max(1, keep_last + 1 - existing) * checkpoint_size
    if free < needed:
        logger.warning(
            "--out %s: %s free, a checkpoint takes about %s and --keep-last %d keeps %d of them (plus the one being "
            "written): the disk fills after %d more save(s); %s, or pass --keep-last %d",
            out,
            _size(free),
            _size(checkpoint_size),
            keep_last,
            keep_last,
            free // checkpoint_size,
            fixes,
            max(1, free // checkpoint_size - 1),
        )
