"""Subcommands of the ``dflash`` console command, one module each.

Each module exposes ``register(subparsers)``, which adds its parser and sets
``func`` to a callable taking the parsed ``argparse.Namespace`` and returning an
exit code. Heavy imports (torch, transformers) happen inside ``func`` so that
``dflash --help`` stays instant.
"""
