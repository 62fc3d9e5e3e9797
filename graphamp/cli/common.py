"""What the model-taking subcommands share: the model and dtype arguments, and loading the model."""

from __future__ import annotations

import argparse
from typing import Any

from graphamp.testing import zoo

__all__ = ["add_model_arguments", "load_model"]

MODEL_HELP = "built-in model name (graphamp.testing.zoo) or module:factory returning (model, args[, kwargs]) or a zoo Case"


def add_model_arguments(p: argparse.ArgumentParser, *, dtype_default: str | None = None, dtype_help: str | None = None, train_help: str | None = None) -> None:
    """--model, --dtype and (when ``train_help`` is given) --train."""
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default=dtype_default,
                   help=dtype_help or "default: autocast's default for the device (cpu bf16, cuda fp16)")
    if train_help is not None:
        p.add_argument("--train", action="store_true", help=train_help)


def load_model(args: argparse.Namespace) -> tuple[Any, tuple, dict]:
    """The model (in train mode with --train, else eval) and its example inputs."""
    case = zoo.build(args.model)
    model = case.model.train(bool(getattr(args, "train", False)))
    inputs, kwargs = case.inputs
    return model, inputs, kwargs
