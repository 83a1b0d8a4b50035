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
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash.files import atomic_write_bytes
from dflash.run.layout import COMPILE_CACHE_NAME as CACHE_NAME

logger = logging.getLogger(__name__)


def load(out: Path) -> bool:
    """Load ``out/compile_cache.bin`` into this process's compile caches, if there is one.

    Returns:
        bool: whether artifacts were loaded (a file that cannot be read or loaded is logged and
        skipped: the step then compiles from nothing, as it would without the file).
    """
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
    nothing when there are none, e.g. an eager run). A failure is logged, never raised: the run
    goes on, and a resume compiles again."""
    path = Path(out) / CACHE_NAME
    if not hasattr(torch.compiler, "save_cache_artifacts"):
        logger.info("compile artifacts not kept: torch %s has no portable compile cache (2.7+)", torch.__version__)
        return
    try:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return
        data, info = artifacts
        atomic_write_bytes(path, data)
    except Exception as e:  # a cache must never stop training; the warning names what failed
        logger.warning("%s: not written (%s: %s); a resume compiles the drafter step again", path, type(e).__name__, e)
        return
    logger.info("compile artifacts saved to %s (%.1f MB: %s)", path, len(data) / 1e6, _describe(info))


def _describe(info) -> str:
    """Artifact counts by kind, e.g. ``inductor 3, aot_autograd 1``."""
    kinds = dict(info.artifacts) if info is not None else {}
    return ", ".join(f"{kind} {len(keys)}" for kind, keys in sorted(kinds.items())) or "no artifacts"
