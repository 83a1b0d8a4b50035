"""`dflash patches` (placeholder)."""


def register(subparsers) -> None:
    parser = subparsers.add_parser("patches", help="(not yet implemented)")
    parser.set_defaults(func=lambda args: 1)
