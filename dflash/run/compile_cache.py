"""The drafter step's compile artifacts, kept in the run directory (``compile_cache.bin``).

A compiled drafter step costs minutes before step 1 (inductor's kernels, AOTAutograd's joint
graph, Triton autotuning). PyTorch's portable "mega-cache" (``torch.compiler.save_cache_artifacts``
/ ``load_cache_artifacts``, torch >= 2.7) serialises what a compile put into those caches; loading
it into a fresh process, on this host or another with the same torch, GPU and drafter shape,
turns the next compile of the same graphs into cache hits. Rank 0 saves it after the first step
of a run and again with each checkpoint (later compiles, e.g. other row lengths, join it); every
process loads it before its first compile, so a resume (or a run on another host with the same
``--out``) starts warm. Nothing is written with ``--no-save``. Artifacts of another torch or shape are keyed so that
they never match: they cost a read, not a wrong kernel.

The mega-cache holds only what ``torch.compile`` made. Triton kernels called eagerly, such as
flash-linear-attention's in a hybrid target's forward, autotune on their first call (each
candidate config compiled and timed); Triton keeps the result in its own cache directory
(``<key>/<kernel>.autotune.json``, ``cache_results=True``, which flash-linear-attention sets), keyed
by Triton's version, the GPU, the kernel's source and the tuning key. Those files travel beside
the mega-cache (``triton_autotune.json``) and are put back where Triton looks for them, so a
resume on another host skips the autotuning too. An entry another Triton or GPU wrote is keyed
apart and never read.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch

from dflash.files import atomic_write_bytes
from dflash.run.layout import AUTOTUNE_NAME
from dflash.run.layout import COMPILE_CACHE_NAME as CACHE_NAME

logger = logging.getLogger(__name__)


#: An autotune entry's path under Triton's cache directory: one key directory, one result file.
_AUTOTUNE_ENTRY = re.compile(r"[A-Za-z0-9_-]+/[A-Za-z0-9_.-]+\.autotune\.json")


def load(out: Path) -> bool:
    """Load ``out/compile_cache.bin`` into this process's compile caches, if there is one, and put
    ``out/triton_autotune.json``'s entries in Triton's cache directory (:func:`load_autotune`).

    Returns:
        bool: whether compile artifacts were loaded (a file that cannot be read or loaded is logged
        and skipped: the step then compiles from nothing, as it would without the file).
    """
    load_autotune(out)
    path = Path(out) / CACHE_NAME
    if not path.is_file():
        return False
    if not hasattr(torch.compiler, "load_cache_artifacts"):
        logger.warning("%s: not loaded: torch %s has no portable compile cache (2.7+)", path, torch.__version__)
        return False
    try:
        # torch logs a damaged file and returns None; other failures raise.
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
        problem = None if info is not None else "torch could not read it (damaged, or from another torch)"
    except Exception as e:  # a damaged cache must not stop training; the warning names it
        problem = f"{type(e).__name__}: {e}"
    if problem is not None:
        logger.warning("%s: not loaded (%s); the drafter step compiles from nothing", path, problem)
        return False
    logger.info("compile artifacts loaded from %s (%s)", path, _describe(info))
    return True


def save(out: Path) -> None:
    """Write this process's compile artifacts so far to ``out/compile_cache.bin`` (atomically;
    nothing when there are none, e.g. an eager run, or when the file already holds them), and Triton's autotune results
    (:func:`save_autotune`). A failure is logged, never raised: the run goes on, and a resume
    compiles again."""
    save_autotune(out)
    path = Path(out) / CACHE_NAME
    if not hasattr(torch.compiler, "save_cache_artifacts"):
        logger.info("compile artifacts not kept: torch %s has no portable compile cache (2.7+)", torch.__version__)
        return
    try:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return
        data, info = artifacts
        if path.is_file() and path.read_bytes() == data:  # nothing compiled since the last save, or the load
            return
        atomic_write_bytes(path, data)
    except Exception as e:  # a cache must never stop training; the warning names what failed
        logger.warning("%s: not written (%s: %s); a resume compiles the drafter step again", path, type(e).__name__, e)
        return
    logger.info("compile artifacts saved to %s (%.1f MB: %s)", path, len(data) / 1e6, _describe(info))


def _describe(info) -> str:
    """Artifact counts by kind, e.g. ``inductor 3, aot_autograd 1``."""
    kinds = dict(info.artifacts) if info is not None else {}
    return ", ".join(f"{kind} {len(keys)}" for kind, keys in sorted(kinds.items())) or "no artifacts"


def triton_cache_dir() -> Path | None:
    """Triton's cache directory (``TRITON_CACHE_DIR``, else under the home directory), or None
    without Triton (CPU builds of torch)."""
    try:
        from triton import knobs
    except ImportError:
        try:  # Triton before 3.4 (torch 2.5-2.7) reads the variable where it opens its cache
            from triton.runtime.cache import default_cache_dir
        except ImportError:
            return None
        return Path(os.getenv("TRITON_CACHE_DIR", "").strip() or default_cache_dir())
    return Path(knobs.cache.dir)


def save_autotune(out: Path) -> int:
    """Write every autotune result in Triton's cache directory to ``out/triton_autotune.json``
    (atomically; nothing when there are none or no Triton).

    Returns:
        int: the entries written. A failure is logged, never raised.
    """
    cache_dir, path = triton_cache_dir(), Path(out) / AUTOTUNE_NAME
    if cache_dir is None or not cache_dir.is_dir():
        return 0
    try:
        entries = {
            entry.relative_to(cache_dir).as_posix(): entry.read_text()
            for entry in sorted(cache_dir.glob("*/*.autotune.json"))
        }
        if entries:
            atomic_write_bytes(path, json.dumps(entries, sort_keys=True).encode())
    except (OSError, UnicodeDecodeError) as e:
        logger.warning("%s: not written (%s: %s); a resume autotunes Triton's kernels again", path, type(e).__name__, e)
        return 0
    if entries:
        logger.info("Triton autotune results saved to %s (%d kernel keys)", path, len(entries))
    return len(entries)


def load_autotune(out: Path) -> int:
    """Put each entry of ``out/triton_autotune.json`` in Triton's cache directory where that
    directory lacks it (an entry already there is this host's own and stays).

    Returns:
        int: the entries put in. A file that cannot be read, or an entry whose name is not an
        autotune result's (``<key>/<kernel>.autotune.json``), is logged and skipped.
    """
    path, cache_dir = Path(out) / AUTOTUNE_NAME, triton_cache_dir()
    if cache_dir is None or not path.is_file():
        return 0
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, dict) or not all(isinstance(v, str) for v in entries.values()):
            raise ValueError("not a JSON object of file texts")
        put = 0
        for name, text in entries.items():
            if not _AUTOTUNE_ENTRY.fullmatch(name):
                logger.warning("%s: entry %r skipped: not <key>/<kernel>.autotune.json", path, name)
                continue
            target = cache_dir / name
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(target, text.encode())
                put += 1
    except (OSError, ValueError) as e:
        logger.warning("%s: not loaded (%s: %s); Triton's kernels autotune again", path, type(e).__name__, e)
        return 0
    logger.info("Triton autotune results from %s: %d of %d put in %s", path, put, len(entries), cache_dir)
    return put
