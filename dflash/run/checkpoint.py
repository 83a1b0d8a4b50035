"""Crash-safe checkpoints: the drafter in the z-lab layout plus the exact training state.

The step directory's layout, and finding and verifying one, are :mod:`dflash.run.step_dirs`'s;
this module writes and reads them.

Every write is atomic: files go into ``step_N.tmp/`` and are fsynced, the directory is renamed
to ``step_N`` (one ``rename``), then ``latest`` is replaced through a temp file + ``os.replace``.
A kill at any point leaves the previous checkpoint and ``latest`` untouched; a stale
``step_N.tmp`` is deleted by the next save; a write the OS refuses (disk full) removes it at
once and raises :class:`CheckpointError` with the fix. Loading checks the manifest, so a truncated or
edited file is reported by name with the fix instead of failing deep inside torch.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from dflash.choices import check_choice
from dflash.config import SaveDtype
from dflash.drafter.files import CONFIG_NAME, WEIGHTS_NAME, CheckpointError
from dflash.drafter.hf_config import MODELING_FILE, modeling_source, portable_config
from dflash.files import atomic_write_bytes, fsync_dir
from dflash.run.layout import LATEST_NAME, MANIFEST_NAME, checkpoints_dir, step_dir_name, step_dirs
from dflash.run.step_dirs import write_manifest

logger = logging.getLogger(__name__)

STATE_NAME = "training_state.pt"
#: Key of the full-precision drafter weights in the training state (see :func:`save_checkpoint`).
MASTER_WEIGHTS_KEY = "master_weights"


# ---------------------------------------------------------------------------------------
# RNG state (all of it, for exact resume)
# ---------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Python, numpy (if installed), torch CPU and all CUDA generator states."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        # Plain Python types so the state loads with torch.load(weights_only=True).
        state["numpy"] = (kind, keys.tolist(), int(pos), int(has_gauss), float(cached))
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved (CUDA only when this host has the same GPUs)."""
    random.setstate(_as_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) != torch.cuda.device_count():
            logger.warning(
                "checkpoint has %d CUDA RNG states, this host has %d GPUs: CUDA RNG not restored",
                len(state["cuda"]),
                torch.cuda.device_count(),
            )
        else:
            torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value):
    # torch.load turns tuples into lists only for some protocols; random.setstate needs tuples.
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


# ---------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------


def resolve_save_dtype(choice: SaveDtype, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype to export drafter weights in, for ``--save-dtype``.

    Args:
        choice (SaveDtype): ``auto`` (``compute_dtype``), ``bfloat16``, ``float16`` or ``float32``.
        compute_dtype (torch.dtype): what the drafter computes in (bf16 under CUDA autocast,
            float32 on CPU); published drafters are bf16.

    Raises:
        ValueError: an unknown choice, naming the valid ones.
    """
    check_choice("save_dtype", choice, SaveDtype)
    return compute_dtype if choice == "auto" else getattr(torch, choice)


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    *,
    weights: dict[str, torch.Tensor],
    drafter_config: dict[str, Any],
    training_state: dict[str, Any] | None,
    keep_last: int = 2,
    dtype: torch.dtype | None = None,
) -> Path:
    """Atomically save a drafter (+ training state) as ``<out_dir>/checkpoints/step_<step>``.

    The step directory is a complete drafter for vLLM, SGLang and ``transformers``:
    ``config.json`` (:func:`dflash.drafter.hf_config.portable_config`), ``modeling_dflash.py`` and
    ``model.safetensors``.

    Args:
        weights: drafter state dict under the public names, any device/dtype (moved to CPU,
            contiguous).
        drafter_config: the drafter config dict (``DFlashDraftConfig.to_diff_dict()``); RoPE,
            ``auto_map`` and ``dtype`` are added for every loader.
        training_state: what :func:`load_training_state` returns on resume; None for a
            weights-only export. When ``dtype`` changes a weight's dtype, the training state also
            keeps the weights as given under :data:`MASTER_WEIGHTS_KEY`, so a resume is exact
            (:func:`resume_weights`); one that holds that key already (the training weights of a
            drafter whose ``weights`` are its published form: projected selector codebooks) keeps it.
        keep_last: complete checkpoints to keep; older ones are deleted after the save.
        dtype: dtype of the floating weights in ``model.safetensors`` (see
            :func:`resolve_save_dtype`); None saves them as they are.

    Returns:
        Path: the new step directory.

    Raises:
        ValueError: ``drafter_config`` has no RoPE base (before anything is written).
        CheckpointError: the OS refused a write (disk full, quota, permissions); the temp
            directory is removed first, the previous checkpoints and ``latest`` are untouched.
    """
    exported = {k: _export(v, dtype) for k, v in weights.items()}
    config = portable_config(drafter_config, dtype=_single_dtype(exported))
    narrowed = any(exported[k].dtype != v.dtype for k, v in weights.items())
    if training_state is not None and MASTER_WEIGHTS_KEY not in training_state and narrowed:
        master = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
        training_state = {**training_state, MASTER_WEIGHTS_KEY: master}

    root = checkpoints_dir(out_dir)
    name = step_dir_name(step)
    tmp, final = root / f"{name}.tmp", root / name
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step_*.tmp"):
            shutil.rmtree(stale)
        tmp.mkdir()
        _write_step(tmp, config, exported, training_state)
    except Exception as error:
        shutil.rmtree(tmp, ignore_errors=True)
        os_error = _os_error(error)
        if os_error is None:
            raise
        raise CheckpointError(_write_failure(root, step, os_error)) from error

    if final.exists():  # re-saving a step (e.g. the final save right after a periodic one)
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(root)
    atomic_write_bytes(root / LATEST_NAME, (name + "\n").encode())
    _prune(root, keep_last)
    logger.info("saved checkpoint %s", final)
    for path in sorted(final.iterdir()):
        logger.debug("  %s: %d bytes", path.name, path.stat().st_size)
    return final


def write_drafter_files(
    directory: Path, *, weights: dict[str, torch.Tensor], drafter_config: dict[str, Any], dtype: torch.dtype | None
) -> None:
    """Write a weights-only drafter into the empty ``directory``: what a step directory holds less
    the training state (``config.json``, ``modeling_dflash.py``, ``model.safetensors`` with the
    floating weights in ``dtype``, ``manifest.json``), fsynced.

    Raises:
        ValueError: ``drafter_config`` has no RoPE base.
    """
    exported = {k: _export(v, dtype) for k, v in weights.items()}
    _write_step(directory, portable_config(drafter_config, dtype=_single_dtype(exported)), exported, None)


def _single_dtype(weights: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype of the floating weights when they share one (what ``dtype="auto"`` loads in)."""
    float_dtypes = {v.dtype for v in weights.values() if v.is_floating_point()}
    return float_dtypes.pop() if len(float_dtypes) == 1 else None


def _write_step(tmp: Path, config: dict[str, Any], weights: dict[str, torch.Tensor], training_state) -> None:
    """Write and fsync the files of a step directory, manifest last, into the empty ``tmp``."""
    from safetensors.torch import save_file

    (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (tmp / MODELING_FILE).write_bytes(modeling_source())
    save_file(weights, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    # safetensors writes 0600; serving engines often run as another user.
    os.chmod(tmp / WEIGHTS_NAME, 0o644)
    names = [CONFIG_NAME, MODELING_FILE, WEIGHTS_NAME]
    if training_state is not None:
        # Through a Python file, so a failed write leaves its OSError as the context of torch's
        # RuntimeError (given a path, torch reports only "unexpected pos" from its C++ stream).
        with open(tmp / STATE_NAME, "wb") as f:
            torch.save(training_state, f)
        names.append(STATE_NAME)
    write_manifest(tmp, names)
    for n in names + [MANIFEST_NAME]:
        with open(tmp / n, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(tmp)


# safetensors reports an I/O failure as text only: "... No space left on device (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _os_error(error: BaseException) -> OSError | None:
    """The operating-system error behind a failed write: ``error`` itself, one it was raised
    from or during (torch.save), or the errno in a SafetensorError's text; None for other failures."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    match = _RUST_OS_ERROR.search(str(error))
    if match is not None:
        code = int(match.group(1))
        return OSError(code, os.strerror(code))
    return None


def _write_failure(root: Path, step: int, error: OSError) -> str:
    """The one-line message of a checkpoint save that the OS refused (names directory, error and fix)."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space on that disk (or pass another --out)"
    else:
        fix = f"make {root} writable (or pass another --out)"
    steps = step_dirs(root)
    kept = f"the previous checkpoint {steps[-1].name} is intact" if steps else "no earlier checkpoint was saved"
    code = errno.errorcode.get(error.errno, error.errno)
    return (
        f"could not save the checkpoint of step {step} in {root}: {error.strerror or error} [{code}]; "
        f"its partial step_{step:08d}.tmp was removed and {kept}: {fix}"
    )


def _export(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    tensor = tensor.detach().to("cpu")
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.contiguous()


def _prune(root: Path, keep_last: int) -> None:
    steps = step_dirs(root)
    for old in steps[:-keep_last]:
        shutil.rmtree(old)


# ---------------------------------------------------------------------------------------
# Load (a step directory :func:`dflash.run.step_dirs.find_checkpoint` found)
# ---------------------------------------------------------------------------------------


def load_drafter_files(step_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json dict, weights on CPU)`` of a verified step directory."""
    from safetensors.torch import load_file

    return json.loads((step_dir / CONFIG_NAME).read_text()), load_file(str(step_dir / WEIGHTS_NAME))


def resume_weights(step_dir: Path, training_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The drafter weights to resume training from: the full-precision copy the training state
    keeps when ``model.safetensors`` was exported in a narrower dtype, else ``model.safetensors``.

    Args:
        step_dir: a verified step directory.
        training_state: its :func:`load_training_state`.
    """
    if MASTER_WEIGHTS_KEY in training_state:
        return training_state[MASTER_WEIGHTS_KEY]
    return load_drafter_files(step_dir)[1]


def load_training_state(step_dir: Path) -> dict[str, Any]:
    """The training state saved with :func:`save_checkpoint` (CPU tensors).

    Raises:
        CheckpointError: the directory holds a weights-only export.
    """
    path = step_dir / STATE_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{path}: no training state (weights-only export); it can be evaluated "
            "but not resumed; train into a new --out"
        )
    return torch.load(path, map_location="cpu", weights_only=True)
