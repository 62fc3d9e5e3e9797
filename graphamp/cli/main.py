"""Entry point of the ``graphamp`` console script."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphamp", description=__doc__)
    parser.add_subparsers(dest="command")
    args = parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
