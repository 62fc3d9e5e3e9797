"""``graphamp.search``: a small set of fp32 modules that makes the converted model pass.

Each trial converts the model with a candidate ``Config`` and runs it beside its fp32 reference
(:mod:`graphamp.explain.numerics`), which gives both the outputs ``validate`` judges and the
per-module ranking the next step follows:

1. **Overflow first.** If some ops overflow from finite inputs (``local_overflow``), keep the
   innermost modules holding them, all at once: each overflows on its own.
2. **Otherwise descend the module tree** from the root toward the module whose own ops add the
   most error, while one child holds at least half of its parent's; keep the module where the
   error stops being concentrated.
3. **Then shrink**: try dropping each kept module, and replacing each by its worst child.

Every trial is logged on the ``graphamp.search`` logger (INFO, ``record.trial``), and the final
:class:`SearchReport` too (``record.report``): trials, the result's accuracy and speed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from graphamp.config import Config
from graphamp.convert import check_inputs
from graphamp.pipeline import build
from graphamp.eager import rng_kept
from graphamp.errors import SearchError, SearchWarning
from graphamp.explain import Explanation, explain_converted
from graphamp.explain.numerics import buffers_restored, run_fp32, run_side_by_side
from graphamp.spec import AmpSpec, autocast_off

__all__ = ["search", "SearchReport", "Trial", "default_validate"]

logger = logging.getLogger("graphamp.search")

# Default tolerances by low dtype: max |out - fp32| <= atol + rtol * max |fp32|, per output.
_RTOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2}
_ATOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Trial:
    """One conversion the search tried."""

    index: int
    fp32_modules: tuple[str, ...]
    passed: bool
    nonfinite: int  # inf/nan in the outputs where fp32 has none
    max_rel: float | None  # worst output's max |out - fp32| / max |fp32|
    seconds: float
    why: str  # what guided the candidate

    def describe(self) -> str:
        kept = ", ".join(self.fp32_modules) or "(nothing in fp32)"
        rel = "-" if self.max_rel is None else f"{self.max_rel:.3g}"
        return f"trial {self.index}: {'pass' if self.passed else 'fail'}  fp32: {kept}  [{self.why}]  inf/nan {self.nonfinite}, max rel {rel}, {self.seconds:.2f} s"


@dataclasses.dataclass(frozen=True)
class SearchReport:
    """What :func:`search` did: its trials, the Config found, its accuracy and speed (ms per call)."""

    config: Config | None  # None when nothing passed
    trials: tuple[Trial, ...]
    max_trials: int
    already_passed: bool
    outputs_max_rel: float | None  # the result against the fp32 model
    outputs_sqnr_db: float | None
    ms_fp32: float | None  # the fp32 model
    ms_low: float | None  # converted with no fp32 modules
    ms_result: float | None  # converted with the result

    def __str__(self) -> str:
        lines = [t.describe() for t in self.trials]
        if self.already_passed:
            lines.append("the model already passes with autocast's policy: nothing to keep in fp32 (empty Config)")
        elif self.config is None:
            lines.append(f"no passing Config within max_trials={self.max_trials}")
        else:
            kept = ", ".join(str(m) for m in self.config.fp32_modules)
            lines.append(f"result after {len(self.trials)} of at most {self.max_trials} trials: fp32_modules=({kept})")
        if self.outputs_max_rel is not None:
            lines.append(f"accuracy vs fp32: max rel {self.outputs_max_rel:.3g}, SQNR {self.outputs_sqnr_db:.1f} dB")
        if self.ms_result is not None:
            lines.append(f"speed, ms per call: fp32 {self.ms_fp32:.2f}, all low {self.ms_low:.2f}, result {self.ms_result:.2f}")
        return "\n".join(lines)


def default_validate(reference: Any, dtype: torch.dtype, atol: float | None = None, rtol: float | None = None) -> Callable[[Any], bool]:
    """The default check: every floating output finite and max |out - ref| <= atol + rtol * max |ref|.

    >>> ok = default_validate(torch.ones(3), torch.float16)
    >>> assert ok(torch.ones(3, dtype=torch.float16)) and not ok(torch.full((3,), float("inf")))
    """
    atol = _ATOL if atol is None else atol
    rtol = _RTOL.get(dtype, 1e-2) if rtol is None else rtol
    want = pytree.tree_leaves(reference)

    def validate(outputs: Any) -> bool:
        got = pytree.tree_leaves(outputs)
        for g, w in zip(got, want):
            if not (isinstance(g, torch.Tensor) and g.is_floating_point()):
                continue
            if not torch.isfinite(g).all() or g.shape != w.shape:
                return False
            if (g.double() - w.double()).abs().max() > atol + rtol * w.double().abs().max():
                return False
        return True

    return validate


def search(
    model: nn.Module,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device_type: str | None = None,
    config: Config | None = None,
    validate: Callable[[Any], bool] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    max_trials: int = 32,
) -> Config:
    """A Config whose ``fp32_modules`` are a small set of modules that makes the converted model pass.

    Args:
        model, args, kwargs, dtype, device_type: as for :func:`graphamp.convert`.
        config: a starting Config (op overrides, modules already kept); the result extends it.
        validate: ``validate(outputs) -> bool`` on the converted model's outputs for ``args``;
            default: all floating outputs finite and ``max|out - fp32| <= atol + rtol * max|fp32|``
            against the fp32 model (rtol 1e-2 for fp16, 4e-2 for bf16; atol 1e-5).
        max_trials: at most this many conversions are tried (each runs the model once).

    Returns the Config (pass it to ``convert``, ``TrainStep`` or the backend). If the model already
    passes, returns ``config`` (the empty Config by default) and warns ``SearchWarning``. Raises
    :class:`graphamp.SearchError` (with ``.report``) when no trial passes. Trials and the result's
    accuracy and speed are logged on the ``graphamp.search`` logger.

    >>> import torch
    >>> from torch import nn
    >>> _ = torch.manual_seed(0)  # an unseeded model and input pass validate now and then
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    >>> with torch.no_grad():
    ...     _ = model[1].weight.mul_(1e5)
    >>> cfg = search(model, (torch.randn(4, 8),), dtype=torch.float16, max_trials=4)
    >>> assert cfg.fp32_modules == ("1",)
    """
    args, kwargs = check_inputs(model, args, kwargs, "graphamp.search")
    if validate is not None and not callable(validate):
        raise TypeError(
            f"validate must be a callable validate(outputs) -> bool, got {type(validate).__name__}; "
            "or leave it None to compare with the fp32 model within atol/rtol"
        )
    if isinstance(max_trials, bool) or not isinstance(max_trials, int):
        raise TypeError(f"max_trials must be an int, got {type(max_trials).__name__}")
    if max_trials < 1:
        raise ValueError(f"max_trials={max_trials}: the search needs at least 1 trial (the first checks the model as autocast converts it)")
    for name, tol in (("atol", atol), ("rtol", rtol)):
        if tol is not None and (not isinstance(tol, (int, float)) or tol < 0 or math.isnan(tol)):
            raise ValueError(f"{name}={tol!r} must be a number >= 0")
    spec = AmpSpec.resolve(model, (args, kwargs), dtype=dtype, device_type=device_type, config=config)
    reference = run_fp32(model, args, kwargs)
    if validate is None:
        validate = default_validate(reference, spec.dtype, atol, rtol)
    return _Search(model, args, kwargs, spec, validate, reference, max_trials).run()


class _Search:
    def __init__(self, model: nn.Module, args: tuple, kwargs: dict, spec: AmpSpec, validate: Callable[[Any], bool], reference: Any, max_trials: int) -> None:
        self.model, self.args, self.kwargs, self.spec = model, args, kwargs, spec
        self.validate, self.reference, self.max_trials = validate, reference, max_trials
        self.trials: list[Trial] = []
        self.explained: dict[tuple[str, ...], Explanation] = {}
        self.converted: dict[tuple[str, ...], Any] = {}

    def _config(self, kept: tuple[str, ...]) -> Config:
        return dataclasses.replace(self.spec.config, fp32_modules=tuple(self.spec.config.fp32_modules) + kept)

    def trial(self, kept: tuple[str, ...], why: str) -> bool:
        start = time.perf_counter()
        spec = dataclasses.replace(self.spec, config=self._config(kept))
        amp = build(self.model, self.args, self.kwargs, spec)
        run = run_side_by_side(amp, self.model, self.args, self.kwargs)
        explanation = explain_converted(self.model, amp, self.args, self.kwargs, spec, run=run)
        outputs = run[1]
        try:
            passed = bool(self.validate(outputs))
        except Exception as e:
            raise TypeError(f"validate raised {type(e).__name__}: {e}; it must take the model's outputs and return a bool") from e
        nonfinite = sum(o.nonfinite for o in explanation.outputs)
        rels = [o.max_rel for o in explanation.outputs if o.max_rel is not None]
        t = Trial(len(self.trials), kept, passed, nonfinite, max(rels) if rels else None, time.perf_counter() - start, why)
        self.trials.append(t)
        self.explained[kept], self.converted[kept] = explanation, amp
        logger.info("%s", t.describe(), extra={"trial": t})
        return passed

    @property
    def budget(self) -> int:
        return self.max_trials - len(self.trials)

    def run(self) -> Config:
        if self.trial((), "autocast's policy"):
            report = self._report(self.spec.config, ())
            warnings.warn(SearchWarning(
                "graphamp.search: the model already passes validate as autocast converts it; "
                "returning the Config unchanged (nothing kept in fp32)"
            ), stacklevel=3)
            return report.config
        kept: tuple[str, ...] = ()
        passed = False
        while not passed and self.budget > 0:
            step = self._next(kept)
            if step is None:
                break
            modules, why = step
            kept = kept + tuple(m for m in modules if m not in kept)
            passed = self.trial(kept, why)
        if not passed:
            report = self._report(None, None)
            error = SearchError(
                f"graphamp.search: no set of fp32 modules passed validate within max_trials={self.max_trials} "
                f"(last tried: {', '.join(kept) or 'nothing'}). Way out: raise max_trials, loosen atol/rtol "
                "or validate, use dtype=torch.bfloat16 (fp32's range), or look at graphamp.explain(model, args)."
            )
            error.report = report
            raise error
        kept = self._shrink(kept)
        return self._report(self._config(kept), kept).config

    def _next(self, kept: tuple[str, ...]) -> tuple[list[str], str] | None:
        e = self.explained[kept]
        covered = lambda path: any(path == k or path.startswith(k + ".") for k in kept)
        # The modules whose own ops or input casts overflow from finite inputs.
        modules = [m.path for m in e.modules if m.path and m.own_local_overflow and not covered(m.path)]
        if modules:
            return modules, f"overflow from finite inputs in {', '.join(modules)}"
        path = self._descend(e, covered)
        if path is None:
            return None
        return [path], f"descent on local error: {path} ({e.module(path).local_error:.3g})"

    @staticmethod
    def _descend(e: Explanation, covered: Callable[[str], bool]) -> str | None:
        """From the root down, into the child holding most of the local error, while it holds half."""
        children: dict[str, list[Any]] = {}
        for m in e.modules:
            if m.path:
                parent = m.path.rsplit(".", 1)[0] if "." in m.path else ""
                children.setdefault(parent, []).append(m)
        node = e.module("")
        while True:
            options = [c for c in children.get(node.path, []) if not covered(c.path) and c.local_error > 0]
            if not options:
                break
            best = max(options, key=lambda c: c.local_error)
            if node.path and best.local_error < 0.5 * node.local_error:
                break
            node = best
        return node.path or None

    def _shrink(self, kept: tuple[str, ...]) -> tuple[str, ...]:
        """Drop kept modules that are not needed, then narrow each to its worst child if that passes."""
        if len(kept) > 1:
            for m in reversed(kept):
                if self.budget <= 0:
                    return kept
                fewer = tuple(k for k in kept if k != m)
                if self.trial(fewer, f"shrink: without {m}"):
                    kept = fewer
        baseline = self.explained[()]
        for i, m in enumerate(kept):
            while self.budget > 0:
                children = [c for c in baseline.modules if c.path.startswith(m + ".") and c.path.count(".") == m.count(".") + 1 and c.local_error > 0]
                if not children:
                    break
                child = max(children, key=lambda c: (c.local_overflow, c.local_error)).path
                narrower = kept[:i] + (child,) + kept[i + 1:]
                if not self.trial(narrower, f"shrink: {m} -> {child}"):
                    break
                kept, m = narrower, child
        return kept

    def _report(self, config: Config | None, kept: tuple[str, ...] | None) -> SearchReport:
        rel = sqnr = ms_fp32 = ms_low = ms_result = None
        if kept is not None:
            e = self.explained[kept]
            rels = [o.max_rel for o in e.outputs if o.max_rel is not None]
            sqnrs = [o.sqnr_db for o in e.outputs if o.sqnr_db is not None]
            rel, sqnr = (max(rels) if rels else None), (min(sqnrs) if sqnrs else None)
            with buffers_restored(self.model):
                ms_fp32 = _ms(lambda: self.model(*self.args, **self.kwargs))
                ms_low = _ms(lambda: self.converted[()](*self.args, **self.kwargs))
                ms_result = _ms(lambda: self.converted[kept](*self.args, **self.kwargs))
        report = SearchReport(config, tuple(self.trials), self.max_trials, kept == (), rel, sqnr, ms_fp32, ms_low, ms_result)
        logger.info("%s", report, extra={"report": report})
        return report


def _ms(call: Callable[[], Any], repeat: int = 5) -> float:
    """Median milliseconds per call, after one warm-up (no grad, autocast off, buffers untouched)."""
    times = []
    with torch.no_grad(), autocast_off(), rng_kept():
        call()
        for _ in range(repeat):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)
