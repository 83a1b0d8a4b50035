"""Entry point run by ``dflash-patches.pth`` in every interpreter (placeholder)."""


def install() -> None:
    pass
