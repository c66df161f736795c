"""The `meshy` command line."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("meshy: nothing here yet", file=sys.stderr)
    return 1
