"""Models for tests, the benchmark and the CLI: built from configs, random weights, nothing downloaded."""

from graphamp.testing import zoo

__all__ = ["zoo"]
