"""`dflash train` (placeholder)."""


def register(subparsers) -> None:
    parser = subparsers.add_parser("train", help="(not yet implemented)")
    parser.set_defaults(func=lambda args: 1)
