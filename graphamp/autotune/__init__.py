"""Autotune: measure each low-precision op against fp32 on this machine and keep the faster.

The pass that decides per op is :mod:`graphamp.passes.autotune`. Around it: :mod:`~graphamp.autotune.measure`
(timers, the measurement cache, :func:`~graphamp.autotune.measure.measuring`),
:mod:`~graphamp.autotune.plan` (the recorded, replayable decisions), :mod:`~graphamp.autotune.accuracy`
(a tuned program's error against fp32) and :mod:`~graphamp.autotune.compiled` (the choice among compiled
candidate programs).
"""
