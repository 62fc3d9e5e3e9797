"""Autotune: measure each low-precision op against fp32 on this machine and keep the faster.

The pass that decides per op is ``graphamp.passes.autotune``; :mod:`graphamp.autotune.accuracy`
checks a tuned program end to end against fp32.
"""
