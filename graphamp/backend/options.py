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
from graphamp.policy import resolve_dtype
from graphamp.spec import MODES

INNER_COMPILERS = ("inductor", "eager")


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """What ``torch.compile(..., backend="graphamp", options={...})`` accepts.

    >>> opts = BackendOptions.parse({"dtype": torch.float16, "inner": "eager"})
    >>> assert opts.dtype is torch.float16 and opts.inner == "eager" and opts.mode == "exact"
    >>> assert BackendOptions.parse({"cache_enabled": False}).config.cache_enabled is False
    >>> with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
    ...     assert BackendOptions.parse(None).config.cache_enabled is False
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
    # As torch.autocast's cache_enabled (see Config.cache_enabled); None: off if the config turns
    # it off or the enclosing torch.autocast region at compile time does (cache_enabled=False).
    # parse() folds the answer into ``config``, which is what the rewrite reads.
    cache_enabled: bool | None = None
    # In exact mode, where dynamo's graph holds the whole frame: run the frame once under eager
    # autocast and the rewritten graph once, on the call being compiled, and warn
    # (EagerPathWarning) if a returned tensor differs (graphamp.backend.eager_check). Outside
    # autocast, also replay the whole call where dynamo skips code (graphamp.backend.skipped_code).
    self_check: bool = True

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> BackendOptions:
        """Validate ``options`` (a mapping from option name to value; None means all defaults)."""
        if options is None:
            return cls()._with_cache_in_config()
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
        if opts.mode == "budget":
            raise OptionError(
                "option mode='budget' measures the whole model's error against fp32 on its example, which a graph "
                "the compiler hands the backend is not; use graphamp.convert(model, args, mode='budget', compile=True)"
            )
        if not isinstance(opts.inner, str) or opts.inner not in INNER_COMPILERS:
            raise OptionError(f"option inner={opts.inner!r} is not an inner compiler; use one of {INNER_COMPILERS}")
        if opts.config is not None and not isinstance(opts.config, Config):
            raise OptionError(f"option config must be a graphamp.Config, got {type(opts.config).__name__}")
        if opts.config is not None and opts.config.plan is not None and opts.mode != "autotune":
            raise OptionError("option config holds an autotune plan (Config.plan); pass it with option mode='autotune'")
        if not isinstance(opts.self_check, bool):
            raise OptionError(f"option self_check must be True or False, got {opts.self_check!r}")
        if opts.device_type is not None and opts.device_type not in DEVICE_TYPES:
            raise OptionError(f"option device_type={opts.device_type!r} is not supported; use one of {DEVICE_TYPES}")
        if opts.dtype is not None:
            try:
                resolve_dtype(opts.dtype, opts.device_type or "cpu")
            except (TypeError, ValueError) as e:
                raise OptionError(f"option dtype: {e}") from e
        return opts._with_cache_in_config()

    def _with_cache_in_config(self) -> BackendOptions:
        config = self.config or Config()
        if self.cache_enabled is None:
            # As dtype=None reads the enclosing region's dtype: the region's cache setting, read
            # when dynamo calls the backend (it restores the caller's autocast state for that).
            enabled = config.cache_enabled and torch.is_autocast_cache_enabled()
        elif not isinstance(self.cache_enabled, bool):
            raise OptionError(
                f"option cache_enabled must be True or False (as torch.autocast's), got {type(self.cache_enabled).__name__}"
            )
        elif self.cache_enabled and not config.cache_enabled:
            raise OptionError(
                "option cache_enabled=True contradicts option config, whose cache_enabled is False; "
                "pass one of them (options={'cache_enabled': False} or config=Config(cache_enabled=False))"
            )
        else:
            enabled = self.cache_enabled
        if enabled == config.cache_enabled:
            return dataclasses.replace(self, cache_enabled=enabled)
        return dataclasses.replace(self, cache_enabled=enabled, config=dataclasses.replace(config, cache_enabled=enabled))
