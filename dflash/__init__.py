"""DFlash drafter training on thread-safe torch.compile.

Importing this package is cheap and never imports torch: the startup hook
(``dflash.patching.startup``) runs from a ``.pth`` file in every interpreter.
"""

__version__ = "0.1.0"
