"""The environment variables the startup hook reads in every interpreter, before anything else of
dflash is imported (:mod:`dflash.patching.startup`): their names, in a module that imports nothing,
so the hook and the modules it arms (:mod:`dflash.watchdog`) read them from one place without
importing each other.
"""

#: 0/false/no/off: the hook patches nothing (``dflash patches status`` says so); 1/true/yes/on or
#: empty: it patches, as unset; any other value: it patches and warns (:func:`dflash.patching.startup.env_problem`).
DISABLE_ENV = "DFLASH_PATCHES"
#: Seconds: the hook arms this process's watchdog (:func:`dflash.watchdog.arm_from_environment`).
WATCHDOG_ENV = "DFLASH_WATCHDOG_S"
