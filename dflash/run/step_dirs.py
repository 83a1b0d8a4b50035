"""The step directories of a run (``<out>/checkpoints/step_N``, named and listed by
:mod:`dflash.run.layout`): the newest complete one, and their files checked against the manifest,
without torch (``dflash train`` finds a run's checkpoint while it settles its config, before anything
heavy is imported; :mod:`dflash.run.checkpoint` writes and reads them).

Layout under ``<out>/checkpoints/``::

    step_00000100/
        config.json           drafter config (architectures ["DFlashDraftModel"], dflash_config,
                              block_size, num_target_layers, auto_map; otherwise a Qwen3 config
                              with RoPE in both the transformers 4.x and 5.x form)
        modeling_dflash.py    the drafter's code, for ``trust_remote_code=True`` loading
        model.safetensors     drafter weights under the public names (fc.weight, layers.0...), in
                              the export dtype (bf16 when training in bf16)
        training_state.pt     optimizer, scheduler, step, data position, RNG states, train config
                              (+ the full-precision weights when the export dtype is narrower)
        manifest.json         size and sha256 of every file above (written last)
    latest                    text file naming the newest complete step directory

So a step directory doubles as a drafter that vLLM, SGLang and ``transformers`` 4.57+ load
(:mod:`dflash.drafter.hf_config` says what each of them needs).

Loading checks the manifest, so a truncated or edited file is reported by name with the fix instead of
failing deep inside torch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from dflash.drafter.files import CONFIG_NAME, CheckpointError
from dflash.files import sha256_file
from dflash.log_once import once_per_process
from dflash.run.layout import CHECKPOINTS_DIR, LATEST_NAME, MANIFEST_NAME, checkpoints_dir, step_dirs

logger = once_per_process(logging.getLogger(__name__))


def write_manifest(step_dir: Path, names: Sequence[str]) -> None:
    """Write ``manifest.json`` into ``step_dir``: the size and sha256 of each of the files ``names``
    (what :func:`verify_checkpoint` checks)."""
    manifest = {n: {"bytes": (step_dir / n).stat().st_size, "sha256": sha256_file(step_dir / n)} for n in names}
    (step_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def find_checkpoint(path: str | Path, *, verify: bool = True, files: Sequence[str] | None = None) -> Path:
    """Resolve a run directory, its ``checkpoints/`` folder or a step directory to a
    step directory (via ``latest`` where needed), checked against its manifest.

    Without a usable ``latest`` (missing, unreadable, or naming a deleted step, e.g. after the
    user deleted a corrupt newest step as the verify error tells them to), the newest complete
    step directory is taken, with a warning: a ``step_N`` (saves rename ``step_N.tmp`` to it
    only once it is whole; one damaged since is reported by the manifest check, not skipped).

    Args:
        verify: check the files (off: a cheap look, or the load of a checkpoint verified already:
            ``dflash train --resume`` verifies it with its inputs, before the target loads).
        files: the files the caller reads. None (``dflash train --resume``): every file the
            manifest lists, and the manifest must be there. Given (``dflash eval``:
            :data:`DRAFTER_FILES`): each must exist and only they are checked against the
            manifest; a directory without one (a drafter shipped for serving) is used unverified,
            with a warning.

    Raises:
        CheckpointError: no such directory, nothing there, ``latest`` names a missing directory and no step is left,
            or a file is missing/truncated/altered (see :func:`verify_checkpoint`).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"{path}: does not exist; pass a run directory (--out of dflash train) or a step_N directory"
        )
    if checkpoints_dir(path).is_dir():
        path = checkpoints_dir(path)
    latest_file = path / LATEST_NAME
    picked = True
    if latest_file.is_file():
        try:
            latest = latest_file.read_text().strip()
        except (OSError, UnicodeDecodeError):
            latest = ""
        if latest and (path / latest).is_dir():
            path = path / latest
        else:
            path = _newest_complete_step(
                path, f"{latest_file} names {latest or 'nothing readable'}, which does not exist"
            )
    elif not (path / CONFIG_NAME).is_file() and step_dirs(path):
        path = _newest_complete_step(path, f"{latest_file} is missing")
    else:
        picked = False  # the caller named the step directory itself
    if not (path / CONFIG_NAME).is_file():
        raise CheckpointError(
            f"{path}: no checkpoint here (no {CONFIG_NAME}, no {CHECKPOINTS_DIR}/{LATEST_NAME}); "
            "pass a run directory (--out of dflash train) or a step_N directory"
        )
    if verify and not verify_checkpoint(path, files=files, picked=picked):
        logger.warning(
            "%s has no %s (a drafter shipped without it): its files were not verified; loading them as they are",
            path,
            MANIFEST_NAME,
        )
    return path


def _newest_complete_step(root: Path, problem: str) -> Path:
    """The newest ``step_N`` directory in ``root`` (never a half-written ``step_N.tmp``), when
    ``latest`` cannot be used (``problem``).

    Raises:
        CheckpointError: no step directory in ``root``.
    """
    steps = step_dirs(root)
    if not steps:
        raise CheckpointError(
            f"{problem}, and no other step directory is left in {root}; "
            "train into a new --out, or pass a step_N directory that holds a drafter"
        )
    logger.warning("%s; using the newest complete step, %s", problem, steps[-1].name)
    return steps[-1]


def verify_checkpoint(step_dir: Path, *, files: Sequence[str] | None = None, picked: bool = True) -> bool:
    """Check files against ``manifest.json`` (size and sha256).

    Args:
        files: see :func:`find_checkpoint`; None: all files, and no manifest is an error.
        picked: ``step_dir`` was taken from its run's checkpoints, so the fix offered is to
            delete it (the next lookup takes the step before it); False: the user named it,
            and the fix is to restore it or name another.

    Returns:
        bool: True when verified, False when ``files`` are given and there is no manifest.

    Raises:
        CheckpointError: no manifest (incomplete save) when ``files`` is None, an unreadable
            manifest, or a missing/corrupt file, naming it and the fix.
    """
    if picked:
        fix = (
            f"delete {step_dir}: `dflash train --resume` and `dflash eval --drafter` then take the newest "
            f"step left in {step_dir.parent} (or pass one of its step_N directories to dflash eval)"
        )
    else:
        fix = f"copy {step_dir} again from where it came from, or pass another drafter directory"
    manifest_path = step_dir / MANIFEST_NAME
    if files is not None and not manifest_path.exists():
        for name in files:
            if not (step_dir / name).is_file():
                raise CheckpointError(f"{step_dir / name}: missing; a drafter needs {' and '.join(files)}; {fix}")
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{manifest_path}: missing or unreadable ({e}); the checkpoint is incomplete: {fix}"
        ) from None
    for name in manifest if files is None else files:
        file = step_dir / name
        if name not in manifest:
            raise CheckpointError(f"{file}: not listed in {manifest_path}, so it cannot be verified; {fix}")
        expected = manifest[name]
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from the checkpoint; {fix}")
        size = file.stat().st_size
        if size != expected["bytes"]:
            changed = f"{size} bytes, but {manifest_path} lists {expected['bytes']}"
        elif sha256_file(file) != expected["sha256"]:
            changed = f"its content does not match the sha256 {manifest_path} lists"
        else:
            continue
        # Only where an unlisted directory is read at all (a drafter, not a resumed training state).
        on_purpose = (
            f" (edited on purpose? delete {manifest_path}: the directory is then read unverified)"
            if files is not None
            else ""
        )
        raise CheckpointError(
            f"{file}: {changed}: it changed after the checkpoint was saved (edited, corrupt, or cut short by a "
            f"copy){on_purpose}; {fix}"
        )
    return True
