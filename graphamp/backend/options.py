"""What ``torch.compile(..., backend="graphamp", options={...})`` accepts, validated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from graphamp.config import Config
from graphamp.errors import OptionError
from graphamp.policy import DEVICE_TYPES
from graphamp.spec import MODES, resolve_dtype


INNER_COMPILERS = ("inductor", "eager")


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """What ``torch.compile(..., backend="graphamp", options={...})`` accepts.

    >>> opts = BackendOptions.parse({"dtype": torch.float16, "inner": "eager"})
    >>> assert opts.dtype is torch.float16 and opts.inner == "eager" and opts.mode == "exact"
    """

    # torch.bfloat16 or torch.float16 (or "bf16"/"fp16"); None: the autocast dtype of the device
    # at compile time (bf16 on CPU, or the dtype of an enclosing torch.autocast region).
    dtype: torch.dtype | str | None = None
    # "cpu" or "cuda"; None: the device of the graph's floating-point inputs.
    device_type: str | None = None
    # graphamp's mode: "exact" reproduces eager autocast's dtypes bit for bit; "autotune" raises to
    # fp32 the low-precision ops that measure faster in fp32 on this machine.
    mode: str = "exact"
    # A graphamp.Config: op overrides and modules kept in fp32.
    config: Config | None = None
    # The compiler graphamp hands the rewritten graph to: "inductor", or "eager" (AOTAutograd
    # running the forward and backward graphs as they are).
    inner: str = "inductor"

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> BackendOptions:
        """Validate ``options`` (a mapping from option name to value; None means all defaults)."""
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise OptionError(
                f"options must be a dict such as {{'dtype': torch.bfloat16}}, got {type(options).__name__}"
            )
        accepted = [f.name for f in dataclasses.fields(cls)]
        for name in options:
            if name not in accepted:
                raise OptionError(
                    f"torch.compile(backend='graphamp') got the unknown option {name!r}; graphamp "
                    f"accepts {', '.join(accepted)}. torch.compile's own mode= goes to inductor; "
                    "inductor settings belong in torch._inductor.config."
                )
        opts = cls(**options)
        if not isinstance(opts.mode, str) or opts.mode not in MODES:
            raise OptionError(f"option mode={opts.mode!r} is not a graphamp mode; use one of {MODES}")
        if not isinstance(opts.inner, str) or opts.inner not in INNER_COMPILERS:
            raise OptionError(f"option inner={opts.inner!r} is not an inner compiler; use one of {INNER_COMPILERS}")
        if opts.config is not None and not isinstance(opts.config, Config):
            raise OptionError(f"option config must be a graphamp.Config, got {type(opts.config).__name__}")
        if opts.config is not None and opts.config.plan is not None and opts.mode != "autotune":
            raise OptionError("option config holds an autotune plan (Config.plan); pass it with option mode='autotune'")
        if opts.device_type is not None and opts.device_type not in DEVICE_TYPES:
            raise OptionError(f"option device_type={opts.device_type!r} is not supported; use one of {DEVICE_TYPES}")
        if opts.dtype is not None:
            try:
                resolve_dtype(opts.dtype, opts.device_type or "cpu")
            except (TypeError, ValueError) as e:
                raise OptionError(f"option dtype: {e}") from e
        return opts
