"""What ``dflash patches status`` reports: the torch release, whether the hook is active, and each concern's state."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from dflash.patching import cache, importhook
from dflash.patching.plan import FAILED, PENDING, Plan, make_plan
from dflash.patching.startup import DISABLE_ENV, env_disabled

DISABLED = "disabled"


def _settled_plan() -> Plan:
    """The hook's plan after importing every module it targets, so no concern stays ``pending``."""
    finder = importhook.active_finder()
    import torch  # noqa: F401  (the finder builds its plan when torch is imported)

    if finder is not None and finder.plan is not None:
        for module in list(finder.plan.module_patches):
            importlib.import_module(module)
        return finder.plan
    plan = make_plan(Path(sys.modules["torch"].__file__).parent, allow_unverified=False)
    if finder is not None and finder.error is not None:
        plan.refuse_all(finder.error)
    elif env_disabled():
        reason = f"{DISABLE_ENV}={os.environ[DISABLE_ENV]} is set in the environment"
        for outcome in plan.outcomes.values():
            if outcome.state in (PENDING, FAILED):
                outcome.state, outcome.reason = DISABLED, reason
    else:
        plan.refuse_all("the startup hook is not active in this interpreter. " + importhook.TORCH_FIRST_MESSAGE)
    return plan


def collect() -> dict:
    """``{"torch_version": str, "hook_active": bool, "patches": [{"name", "state", "reason"}], "cache": dict}``.

    ``cache`` is :func:`dflash.patching.cache.describe` after this process imported torch
    (its ``faults`` are the entries that import found unreadable and rewrote).
    """
    hook_active = importhook.active_finder() is not None
    plan = _settled_plan()
    return {
        "torch_version": plan.release,
        "hook_active": hook_active,
        "patches": [o.as_dict() for o in plan.outcomes.values()],
        "cache": cache.describe(),
    }


def thread_safety_gap() -> str | None:
    """Why compiling from several threads of this interpreter at once is unsafe, or None when it is safe.

    Safe when every concern of the series is covered in this torch: patched at import (the startup
    hook active), fixed upstream, built into a rebuilt wheel, or absent from this release. Otherwise
    the first uncovered concern with its state and reason (the hook off, torch imported before it,
    an unverified release: what ``dflash patches status`` reports). Imports the torch modules the
    series patches.
    """
    gap = next((o for o in _settled_plan().outcomes.values() if o.state in (FAILED, DISABLED, PENDING)), None)
    return None if gap is None else f"{gap.name} {gap.state}: {gap.reason}"
