"""DFlash drafter training on thread-safe torch.compile.

Importing this package is cheap and never imports torch: the startup hook
(``dflash.patching.startup``) runs from a ``.pth`` file in every interpreter.

Rooms (each folder's docstring names its modules; ``tests/unit/test_package_layout.py`` keeps them and
the README's layout block complete): :mod:`~dflash.patching` (what runs inside ``import torch``),
:mod:`~dflash.patchtools` (the tools around the series), :mod:`~dflash.target_model` (the frozen
target), :mod:`~dflash.drafter` (the trained model), :mod:`~dflash.data` (chats to batches),
:mod:`~dflash.run` (one run and its ``--out``), :mod:`~dflash.evaluation` (speculative decoding and
tau), :mod:`~dflash.train` (the loop and its engines),
:mod:`~dflash.commands` (the subcommands) and :mod:`~dflash.assets` (the embedded default).

Modules of their own: :mod:`~dflash.cli` (the ``dflash`` command), :mod:`~dflash.config` (``dflash
train``'s flags) with its :mod:`~dflash.choices`, :mod:`~dflash.environment` (the startup hook's
variables), :mod:`~dflash.masks` (anchors, labels, the DFlash mask), :mod:`~dflash.devices`,
:mod:`~dflash.distributed` (gradient sums across threads and processes), :mod:`~dflash.files`,
:mod:`~dflash.signals` (a clean stop), :mod:`~dflash.export` (a serving directory),
:mod:`~dflash.compile_watch` (what torch.compile did),
:mod:`~dflash.profiling` (a step under the profiler), :mod:`~dflash.progress_logging` (log lines
above progress bars), :mod:`~dflash.log_once` (warnings said once per process) and
:mod:`~dflash.watchdog` (every thread's stack on a hang).
"""

__version__ = "0.1.0"
