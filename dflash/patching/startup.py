"""Entry point that ``dflash-patches.pth`` (``.start`` on Python 3.15+) runs in every interpreter.

Reads ``DFLASH_PATCHES`` itself (0/false/no/off disables the hook, like
setuptools' own ``.pth`` honours its variable; any other value but 1/true/yes/on
or empty gets a one-line warning on stderr, :func:`env_problem`) and never imports
torch: it only puts a ``sys.meta_path`` finder in place (``importhook.install``).
With ``DFLASH_WATCHDOG_S`` set (a parent that watches this process for hangs), it
first arms the process's watchdog (``dflash.watchdog``), patched or not.
"""

import functools
import os
import sys

from dflash.environment import DISABLE_ENV, WATCHDOG_ENV

#: The values of ``DFLASH_PATCHES`` that turn the hook off, and those that leave it on (as unset does).
OFF = ("0", "false", "no", "off")
ON = ("", "1", "true", "yes", "on")


def _value() -> str:
    return os.environ.get(DISABLE_ENV, "").strip().lower()


def env_disabled() -> bool:
    """``DFLASH_PATCHES`` set to 0/false/no/off."""
    return _value() in OFF


def env_problem() -> str | None:
    """What is wrong with ``DFLASH_PATCHES``, or None: a value neither in :data:`OFF` nor in :data:`ON`.

    The hook stays on then, as when the variable is unset: the patches only make torch.compile
    thread-safe, and guessing "off" from a typo of "on" would turn that safety off.
    """
    if env_disabled() or _value() in ON:
        return None
    return (
        f"{DISABLE_ENV}={os.environ[DISABLE_ENV]!r} is not recognised: the thread-safety patches stay ON. "
        f"Set {DISABLE_ENV}=0 (or false/no/off) to turn them off, 1 (or true/yes/on) or unset to keep them."
    )


@functools.cache
def _warn(problem: str) -> None:
    """Once per interpreter: ``site`` may process site-packages, and so this hook, twice."""
    print(f"dflash: {problem}", file=sys.stderr)


def install() -> None:
    if os.environ.get(WATCHDOG_ENV):
        from dflash import watchdog

        watchdog.arm_from_environment()
    if env_disabled():
        return
    problem = env_problem()
    if problem:
        _warn(problem)
    from dflash.patching import importhook

    importhook.install()
