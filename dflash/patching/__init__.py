"""The patch engine: applies ``patches/`` to torch's own modules as they are imported.

Nothing here imports torch at interpreter start; see ``startup`` for the hook
that the ``dflash-patches.pth`` file runs.

- :mod:`~dflash.patching.startup`: the hook the ``.pth`` file runs;
- :mod:`~dflash.patching.importhook`: the ``sys.meta_path`` finder and loader that patch a torch
  module's source before it executes;
- :mod:`~dflash.patching.plan`: which patches apply to the installed torch, and what became of each;
- :mod:`~dflash.patching.series` reads the series (:mod:`~dflash.patching.series_path` says where it
  lives), :mod:`~dflash.patching.hunks` applies its hunks, :mod:`~dflash.patching.records` reads
  which variants were verified on which release;
- :mod:`~dflash.patching.cache`: the plan and the patched modules cached on disk;
- :mod:`~dflash.patching.status`: what ``dflash patches status`` reports.
"""
