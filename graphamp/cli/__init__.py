"""The ``graphamp`` command line."""

from graphamp.cli.main import main

__all__ = ["main"]
