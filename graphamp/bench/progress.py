"""The bench's progress line and its estimate of the time left, from what this run measured so far."""

from __future__ import annotations

import statistics
import sys
import time

from graphamp.bench.variants import COMPILED

__all__ = ["Estimate", "PRIOR_SETUP_S", "show_progress", "setup_kind"]


def show_progress(message: str) -> None:
    """A one-line progress bar on a terminal; whole lines per phase otherwise (logs, CI)."""
    if sys.stderr.isatty():
        print(f"\r\033[K{message}", end="", file=sys.stderr, flush=True)
    elif message and "round" not in message:
        print(message, file=sys.stderr, flush=True)


# What preparing a variant costs before any is measured (s, this project's 2-core machines, cold
# inductor cache): an eager variant, a conversion, one inductor compile. Replaced by this run's own
# measurement of the same kind as soon as one has run.
PRIOR_SETUP_S = {"eager": 5.0, "convert": 20.0, "compile": 40.0}


def setup_kind(variant: str, cpp_wrapper: bool) -> tuple[str, float]:
    """What preparing ``variant`` costs, as (kind, how many of that kind)."""
    if variant in ("graphamp_autotune_compiled", "trainstep_autotune_compiled"):
        return "compile", 3.0 + 2 * cpp_wrapper  # up to three candidates; inference: unfrozen, then C++-wrapper builds
    if variant == "graphamp_budget_compiled":
        return "compile", 8.0  # a compile per op type tried, about seven on the bench's transformers
    if variant == "graphamp_budget":
        return "convert", 3.0  # a conversion and timed rounds per op type tried
    if variant.startswith("compile_"):
        return "compile", 1.0 + cpp_wrapper
    if variant in COMPILED:
        return "compile", 1.0
    if variant.startswith(("graphamp", "trainstep")):
        return "convert", 1.0
    return "eager", 1.0


class Estimate:
    """Time left in a run, from what this run measured so far: the setup of each kind of variant
    (priors until one of a kind ran; the current model's own setups once it has some, since a
    larger model compiles longer) and each variant's timing rounds (from its warm-up calls as soon
    as it is prepared, then from its measured call; before that, the mean of the same model's
    known rounds)."""

    def __init__(self, work: list[tuple[str, str, tuple[str, float]]], rounds: int) -> None:
        self.start = time.perf_counter()
        self.pending = {(m, v): kind for m, v, kind in work}
        self.rounds = {(m, v): rounds for m, v, _ in work}
        self.round_s: dict[tuple[str, str], float] = {}
        self.measured: dict[tuple[str, str], list[float]] = {}  # setup s per unit, by (model, kind)

    def prepared(self, model: str, variant: str, seconds: float) -> None:
        kind, units = self.pending.pop((model, variant))
        self.measured.setdefault((model, kind), []).append(seconds / units)

    def per_round(self, model: str, variant: str, seconds: float) -> None:
        self.round_s[(model, variant)] = seconds

    def timed(self, model: str, variant: str) -> None:
        self.rounds[(model, variant)] -= 1

    def failed(self, model: str, variant: str) -> None:
        self.rounds[(model, variant)] = 0

    def _setup_s(self, model: str, kind: str) -> float:
        any_model = [s for (_, k), runs in self.measured.items() if k == kind for s in runs]
        return statistics.mean(self.measured.get((model, kind)) or any_model or [PRIOR_SETUP_S[kind]])

    def left_s(self) -> float:
        setup = sum(units * self._setup_s(m, kind) for (m, _), (kind, units) in self.pending.items())
        # Rounds of variants not yet warm: the mean round of the same model's that are, else of
        # any model's (1 s before any).
        overall = statistics.mean(self.round_s.values()) if self.round_s else 1.0
        by_model: dict[str, list[float]] = {}
        for (m, _), seconds in self.round_s.items():
            by_model.setdefault(m, []).append(seconds)
        timing = sum(
            n * self.round_s.get(key, statistics.mean(by_model[key[0]]) if key[0] in by_model else overall)
            for key, n in self.rounds.items() if n > 0
        )
        return setup + timing

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        return f"({elapsed:.0f} s elapsed, about {self.left_s():.0f} s left)"
