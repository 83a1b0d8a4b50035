"""The patch engine: applies ``patches/`` to torch's own modules as they are imported.

Nothing here imports torch at interpreter start; see ``startup`` for the hook
that the ``dflash-patches.pth`` file runs.
"""
