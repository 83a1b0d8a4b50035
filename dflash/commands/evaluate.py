"""`dflash evaluate` (placeholder)."""


def register(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="(not yet implemented)")
    parser.set_defaults(func=lambda args: 1)
