"""Tools around the patch series that never run inside ``import torch``.

- :mod:`dflash.patchtools.verify`: two-thread checks that show each bug class on plain torch and
  its absence on patched torch (``dflash patches verify``);
- :mod:`dflash.patchtools.wheel`: rebuild a torch wheel with the series built in
  (``dflash patches build-wheel``);
- :mod:`dflash.patchtools.upstream`: the upstream PyTorch PR kit (``dflash patches upstream``).

What runs at import (the finder, the loader, the plan, the cache) is :mod:`dflash.patching`.
"""
