"""Tools around the patch series that never run inside ``import torch``.

- :mod:`dflash.patchtools.verify`: two-thread checks that show each bug class on plain torch and
  its absence on patched torch (``dflash patches verify``);
- :mod:`dflash.patchtools.wheel`: rebuild a torch wheel with the series built in
  (``dflash patches build-wheel``);
- :mod:`dflash.patchtools.upstream`: the upstream PyTorch PR kit (``dflash patches upstream``);
- :mod:`dflash.patchtools.refresh`: each release's variant of every concern regenerated from its
  source diff (``dflash patches refresh``);
- :mod:`dflash.patchtools.coverage`: which torch releases the series covers (``dflash patches coverage``);
- :mod:`dflash.patchtools.pytorch_tests`: PyTorch's own tests of an exact release tag, plain vs patched
  (``dflash patches pytorch-tests``).

What runs at import (the finder, the loader, the plan, the cache) is :mod:`dflash.patching`.

The packages only these tools use (``merge3`` for the refresh, ``wheel`` for the wheel builder) are the
``patchtools`` extra of ``pyproject.toml``, so an install that runs the startup hook needs neither; a tool
run without its package says which extra installs it (:func:`needs_extra`).
"""


def needs_extra(package: str, tool: str) -> str:
    """What to say when ``tool`` is run without ``package`` of the ``patchtools`` extra."""
    return (
        f"{tool} needs the {package} package, which the patchtools extra installs: "
        f"pip install -e '.[patchtools]' (or pip install {package})"
    )


class MissingExtra(ImportError):
    """A patch tool's package is not installed; the message is :func:`needs_extra`'s."""
