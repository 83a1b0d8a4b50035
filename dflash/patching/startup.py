"""Entry point that ``dflash-patches.pth`` (``.start`` on Python 3.15+) runs in every interpreter.

Reads ``DFLASH_PATCHES`` itself (0/false/no/off disables the hook, like
setuptools' own ``.pth`` honours its variable) and never imports torch: it only
puts a ``sys.meta_path`` finder in place (``importhook.install``). With
``DFLASH_WATCHDOG_S`` set (a parent that watches this process for hangs), it
first arms the process's watchdog (``dflash.watchdog``), patched or not.
"""

import os

from dflash.environment import DISABLE_ENV, WATCHDOG_ENV


def env_disabled() -> bool:
    """``DFLASH_PATCHES`` set to 0/false/no/off."""
    return os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def install() -> None:
    if os.environ.get(WATCHDOG_ENV):
        from dflash import watchdog

        watchdog.arm_from_environment()
    if env_disabled():
        return
    from dflash.patching import importhook

    importhook.install()
