"""The census: is graphamp exact on the real model population? One process per model, a time limit each.

Every architecture transformers builds from a tiny config, a representative set of timm models and
a few diffusers models (``census_models.py``), with random weights. Per model, against eager
``torch.autocast("cpu", dtype)`` and each check guarded on its own:

- ``eager``: eager autocast runs (bf16); if not, the model is counted apart as "eager cannot run";
- ``convert_bf16`` / ``convert_fp16``: ``graphamp.convert`` outputs, values and dtypes, torch.equal;
- ``grads_bf16``: train mode (dropout 0 through the config), a fixed loss over the float outputs
  (tests/helpers.py's recipe), every parameter ``.grad`` torch.equal;
- ``batch``: the module converted at batch 2, called at batches 1 and 3;
- ``backend``: ``torch.compile(model, backend="graphamp", options={"inner": "eager"})``, forward.

convert checks itself against eager autocast on the example, so the checks above re-check what it
already compared (on the example); these do not:

- ``inputs``: the bf16 module converted on the example, called on other values at the same shapes
  (floats redrawn, token ids changed within the vocabulary), on a padded ``attention_mask`` (one row
  right-padded, one left-padded; as a keyword where the example had none) and on input_ids 5 longer;
  each case against eager autocast (eval, no_grad), run or skipped (why) on its own;
- ``dropout``: train mode with the model's own dropout (the config's, rebuilt, for transformers;
  the modules' own p for timm and diffusers; "no dropout in this model" where there is none), the
  same seed right before each call: outputs and every parameter gradient;
- ``export``: ``graphamp.export``'s program on the example and on other values,
  ``graphamp.verify_export`` (eval, no_grad);
- ``backend_autocast``: the backend called inside ``torch.autocast``. Both backend checks count the
  calls of graphamp's backend (dynamo silently runs a frame eagerly past its recompile limit, which
  they raise): "backend not called" is an error, never bitwise. Where the backend fails with an
  error that is not graphamp's and plain ``torch.compile(model, backend="eager")`` (dynamo alone)
  fails too, the check is skipped with both errors: dynamo's own limit, no evidence on graphamp.

A check ends ``bitwise``, ``differ`` (max abs diff, first differing output or gradient, dtype
mismatches), ``error`` (type and first line) or ``skipped`` (why); a check of cases (inputs, export)
is its worst case, with every case under ``cases``. NaN positions count as equal when both sides
have them. "Reported" means graphamp said so itself: an error is reported when it is a typed
graphamp error (``graphamp.GraphampError``), a difference when a graphamp warning (a
``PolicyDriftWarning``, ...) named the differing output or gradient (``output.logits``, ``gradient of
<parameter>``, the backend's ``tensor #i``). A blanket warning never counts; graphamp's warnings
stay in the record for reading. Anything else is "silent".

Each record keeps its CPU seconds (``cpu_s``: the worker's, and each check's) and its commit. A
worker past its time limit has its Python stack dumped twice a few seconds apart (faulthandler on
SIGUSR1) before it is killed: ``"kind": "hang"`` where it used little CPU in between, ``"busy"``
where it used the CPU but its stack did not change (one long native call, or a loop over identical
layers, whose frames read alike: a Python stack cannot tell these from a loop that makes no
progress), ``"slow"`` otherwise, with its innermost frames under ``stack``; ``--rerun-slow LIMIT``
runs the slow and busy ones again with a longer limit, which decides. The limit counts running time only: a run
paused with ``kill -STOP`` (census or worker) makes no time-outs. ``--resume`` refuses a results file written at
another commit, on another CPU class or with other library versions (one table, one commit, one
machine) unless ``--allow-mixed``. ``scripts/census-continue FILE`` continues a file in a later
session: a worktree at the file's commit, its transformers, timm and diffusers versions, ``--resume``.

    scripts/census                                   # everything, resumable: --resume
    scripts/census-continue FILE [--retry-unfinished] # FILE's commit and versions, resumed
    scripts/census --only 'timm/|diffusers/' --jobs 1
    scripts/census --resume --rerun-slow 600          # the slow time-outs again, 600 s each
    .venv/bin/python benchmarks/census.py --summary benchmarks/results/census.jsonl --markdown
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import datetime
import gc
import json
import math
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import census_models

CHECKS = ("convert_bf16", "convert_fp16", "grads_bf16", "batch", "backend", "inputs", "dropout", "export", "backend_autocast")
# The checks that call the bf16 module convert_bf16 made (converted first when not asked for).
NEEDS_AMP = ("batch", "inputs")
DEFAULT_OUT = HERE / "results" / "census.jsonl"
DEFAULT_TIMEOUT = 120.0  # seconds per model
REPORTED_RULE = "named"


# ---------------------------------------------------------------- comparing


def _leaves(out: Any) -> list[tuple[str, Any]]:
    import torch.utils._pytree as pytree

    try:
        flat, _ = pytree.tree_flatten_with_path(out)
    except ValueError:  # a node type registered without key paths (diffusers' output classes)
        return [(f"leaf {i}", leaf) for i, leaf in enumerate(pytree.tree_leaves(out))]
    return [(pytree.keystr(path) or "output", leaf) for path, leaf in flat]


def _plain_object(value: Any) -> bool:
    """An instance with attributes of its own that pytree keeps whole (no container, no tensor)."""
    import torch

    return hasattr(value, "__dict__") and not isinstance(value, (torch.Tensor, type)) and not callable(value)


def _same(a: Any, b: Any) -> bool:
    import torch

    if a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def _diff(a: Any, b: Any) -> float:
    if a.shape != b.shape:
        return math.inf
    d = (a.double() - b.double()).abs()
    d = d[~d.isnan()]
    return d.max().item() if d.numel() else 0.0


def compare_outputs(got: Any, want: Any) -> dict[str, Any] | None:
    """None if equal in values, dtypes and structure; else what differs first and by how much."""
    import torch

    g, w = _leaves(got), _leaves(want)
    if [p for p, _ in g] != [p for p, _ in w] or type(got) is not type(want):
        return {"first": "structure", "detail": f"{type(got).__name__} {len(g)} leaves vs eager {type(want).__name__} {len(w)}", "max_abs_diff": None}
    dtypes = [f"{p}: {a.dtype} vs eager {b.dtype}" for (p, a), (_, b) in zip(g, w) if isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor) and a.dtype != b.dtype]
    first, worst, names = None, 0.0, []
    tensor_index = {p: i for i, p in enumerate(p for p, b in w if isinstance(b, torch.Tensor))}
    for (p, a), (_, b) in zip(g, w):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor) or not _same(a, b) or a.dtype != b.dtype:
                names += _output_names(p, tensor_index.get(p))
            if not isinstance(a, torch.Tensor) or not _same(a, b):
                first = first or p
                if isinstance(a, torch.Tensor):
                    worst = max(worst, _diff(a, b))
        elif _plain_object(a) and type(a) is type(b):
            # An object pytree does not flatten (a Hugging Face cache): its attributes are compared.
            inner = compare_outputs(vars(a), vars(b))
            if inner is not None:
                first = first or f"{p}.{inner['first']}"
                worst = max(worst, inner.get("max_abs_diff") or 0.0)
                names += _output_names(p, None)
        elif a != b:
            first = first or p
            names += _output_names(p, None)
    if first is None and not dtypes:
        return None
    return {"first": first or dtypes[0].split(":")[0], "max_abs_diff": worst, "dtype_mismatch": dtypes[:5], "names": names[:30]}


def _output_names(path: str, tensor_index: int | None) -> list[str]:
    """How graphamp's messages name the output leaf ``path`` (a census leaf name): its self-check
    and verify_export as ``output`` + the pytree key path (``output.logits``, ``output[0]``,
    ``output leaf 2``); the backend's eager check as ``tensor #i`` among the tensors returned."""
    if path == "output":
        names = ["output"]
    elif path.startswith("leaf "):
        names = [f"output {path}"]
    else:
        names = [f"output{path}"]
    return names + ([f"tensor #{tensor_index}"] if tensor_index is not None else [])


def compare_grads(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any] | None:
    if got.keys() != want.keys():
        missing = sorted(set(got) ^ set(want))
        return {"first": f"grad set differs: {missing[:3]}", "max_abs_diff": None}
    bad = [n for n in want if not _same(got[n], want[n])]
    if not bad:
        return None
    return {"first": f"grad {bad[0]}", "max_abs_diff": max(_diff(got[n], want[n]) for n in bad), "differing": len(bad), "of": len(want),
            "names": [f"gradient of {n}" for n in bad[:30]]}


def _loss(out: Any) -> Any:
    # tests/helpers.py's fixed, position-dependent weighting: every output element a distinct gradient.
    import torch

    total = torch.zeros(())
    floats = [t for _, t in _leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    for i, t in enumerate(floats):
        w = torch.linspace(-1, 1, t.numel(), dtype=torch.float32).reshape(t.shape) * (i + 1)
        total = total + (t.float() * w).sum()
    return total


# ---------------------------------------------------------------- one model, in its own process


class Record:
    """One model's results, written to ``path`` after every check so a timeout keeps what finished."""

    def __init__(self, name: str, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {"model": name, "family": name.split("/")[0], "checks": {}, "status": "running", "current": "build"}
        self.start = time.perf_counter()

    def save(self) -> None:
        self.data["seconds"] = round(time.perf_counter() - self.start, 1)
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data))
            tmp.replace(self.path)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def _error(e: BaseException) -> dict[str, Any]:
    import graphamp

    # torch.compile wraps what a backend raises (BackendCompilerFailed): judge and name the error
    # graphamp raised, not the wrapper, whose first line is only "backend='graphamp' raised:".
    inner = getattr(e, "inner_exception", None)
    if isinstance(inner, BaseException):
        e = inner
    where = traceback.extract_tb(e.__traceback__)
    frame = where[-1] if where else None
    return {
        "status": "error",
        "type": type(e).__name__,
        "message": _first_line(e),
        "reported": isinstance(e, graphamp.GraphampError),
        "where": f"{Path(frame.filename).name}:{frame.lineno}" if frame else "",
    }


def _graphamp_warnings(caught: Iterable[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if w.category.__module__.startswith("graphamp")]


def _short(w: warnings.WarningMessage) -> str:
    text = str(w.message).strip()
    return f"{w.category.__name__}: {text.splitlines()[0][:200] if text else ''}"


def _names(message: str, names: Iterable[str]) -> str | None:
    """The first of ``names`` (of the differing outputs and gradients, in graphamp's words: see
    _output_names and compare_grads) that ``message`` names, else None."""
    for name in names:
        if name == "output":  # a single-tensor output: "output differs", "output comes back ..."
            pattern = r"(?<![\w.])output (?:differs|comes back|is )"
        else:
            pattern = r"(?<![\w.])" + re.escape(name) + r"(?![\w.\[])"
        if re.search(pattern, message):
            return name
    return None


def _reported_by(caught: list[warnings.WarningMessage], names: Iterable[str]) -> str | None:
    """A difference counts as reported only when a graphamp warning named what differs: the
    warning's first line, else None. A blanket warning (one that names no differing output or
    gradient) never counts; neither does the emulated-precision one, which names none."""
    names = list(names)
    for w in caught:
        if _names(str(w.message), names):
            return _short(w)
    return None


class EagerFailed(Exception):
    """Eager autocast itself cannot run this check (fp16 kernels, a backward): skipped, not graphamp's."""


class Skipped(Exception):
    """This check or case does not apply to the model (no attention_mask, no input_ids): skipped, why."""


def _clone(inputs: Any) -> Any:
    import torch
    import torch.utils._pytree as pytree

    return pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), inputs)


class Subject:
    """A built model, its pristine state, and eager autocast references computed once each."""

    def __init__(self, built: census_models.Built) -> None:
        from torch import nn

        self.built = built
        self.model = built.model
        # Train mode must be deterministic for the gradient check: dropout modules the config did
        # not reach (timm's classifier drop_rate, hard-coded nn.Dropout) get p=0 too.
        # The modules' own p is kept for the dropout check (timm's, diffusers').
        self.dropout_p = {n: m.p for n, m in self.model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd)}
        for m in self.model.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                m.p = 0.0
        self.state = copy.deepcopy({k: v for k, v in self.model.state_dict(keep_vars=False).items()})
        self._eager: dict[tuple, Any] = {}
        # The eval-mode module per dtype, converted at batch 2: the batch check calls the bf16 one.
        self.amps: dict[Any, Any] = {}

    def reset(self, train: bool = False) -> None:
        import torch

        with torch.no_grad():
            for k, v in self.model.state_dict(keep_vars=True).items():
                v.copy_(self.state[k])
        self.model.train(train)
        self.model.zero_grad(set_to_none=True)

    def inputs(self, batch: int, seed: int = 0, seq: int | None = None) -> tuple[tuple, dict]:
        """The inputs at ``batch``: seed 0 is the example, another seed other values at its shapes;
        ``seq`` another length of input_ids (only where ``built.seq_input``)."""
        if seq is not None:
            return self.built.make_inputs(batch, seed=seed, seq=seq)
        return self.built.make_inputs(batch, seed=seed) if seed else self.built.make_inputs(batch)

    def run(self, call: Callable[..., Any], batch: int | None, *, grads: bool, inputs: tuple | None = None) -> tuple[Any, dict[str, Any] | None]:
        import torch

        self.reset(train=grads)
        torch.manual_seed(0)  # any randomness left in the model draws the same on both sides
        args, kwargs = _clone(inputs) if inputs is not None else self.inputs(batch)
        if grads:
            out = call(*args, **kwargs)
            _loss(out).backward()
            g = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}
            self.model.zero_grad(set_to_none=True)
            return out, g
        with torch.no_grad():
            return call(*args, **kwargs), None

    def eager(self, dtype: Any, batch: int = census_models.BATCH, grads: bool = False) -> tuple[Any, dict[str, Any] | None]:
        import torch

        key = (dtype, batch, grads)
        if key not in self._eager:
            def call(*a: Any, **k: Any) -> Any:
                with torch.autocast("cpu", dtype=dtype):
                    return self.model(*a, **k)

            try:
                self._eager[key] = self.run(call, batch, grads=grads)
            except Exception as e:
                what = f"{str(dtype).removeprefix('torch.')}, batch {batch}{', backward' if grads else ''}"
                raise EagerFailed(f"eager autocast cannot run ({what}): {type(e).__name__}: {_first_line(e)[:200]}") from e
        return self._eager[key]

    def eager_on(self, dtype: Any, inputs: tuple, what: str) -> Any:
        """Eager autocast's outputs on ``inputs`` (eval, no_grad), not cached."""
        import torch

        def call(*a: Any, **k: Any) -> Any:
            with torch.autocast("cpu", dtype=dtype):
                return self.model(*a, **k)

        try:
            return self.run(call, None, grads=False, inputs=inputs)[0]
        except Exception as e:
            raise EagerFailed(f"eager autocast cannot run ({what}): {type(e).__name__}: {_first_line(e)[:200]}") from e

    def convert(self, dtype: Any, *, train: bool) -> Any:
        import graphamp

        self.reset(train=train)
        args, kwargs = self.inputs(census_models.BATCH)
        return graphamp.convert(self.model, args, kwargs, dtype=dtype)


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn``'s result, or its error or skip; ``reported`` as the module docstring says: an error
    when graphamp raised it typed (a GraphampError), a difference when a graphamp warning named the
    differing output or gradient. graphamp's warnings are kept for reading either way."""
    start, cpu = time.perf_counter(), time.process_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn()
        except (EagerFailed, Skipped) as e:
            result = {"status": "skipped", "reason": str(e)}
        except Exception as e:  # the guard: one failing check never stops the others
            result = _error(e)
    ws = _graphamp_warnings(caught)
    if ws:
        result["warnings"] = sorted({_short(w) for w in ws})[:5]
    if result["status"] == "differ" and "reported" not in result:  # a check of cases judged each case
        by = _reported_by(ws, result.get("names", ()))
        result["reported"] = by is not None
        if by:
            result["reported_by"] = by
    result["seconds"] = round(time.perf_counter() - start, 2)
    result["cpu_s"] = round(time.process_time() - cpu, 2)
    return result


# Which case of a check of cases stands for the check: a silent problem before a reported one.
_CASE_ORDER = (("differ", False), ("error", False), ("differ", True), ("error", True))


def _combine(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A check made of cases, each guarded on its own: the check is its worst case (a silent
    difference, a silent error, a reported difference, a reported error), else bitwise where any
    case ran, else skipped; every case's result is kept under ``cases``."""
    for status, reported in _CASE_ORDER:
        bad = [k for k, r in cases.items() if r["status"] == status and bool(r.get("reported")) == reported]
        if bad:
            top = {k: v for k, v in cases[bad[0]].items() if k not in ("seconds", "cpu_s", "warnings")}
            result = {**top, "case": bad[0]}
            break
    else:
        ran = [k for k, r in cases.items() if r["status"] != "skipped"]
        result = {"status": "bitwise"} if ran else {"status": "skipped", "reason": "; ".join(f"{k}: {r.get('reason')}" for k, r in cases.items())}
    result["ran"] = [k for k, r in cases.items() if r["status"] != "skipped"]
    result["skipped"] = {k: r.get("reason") for k, r in cases.items() if r["status"] == "skipped"}
    result["cases"] = cases
    return result


def _verdict(problem: dict[str, Any] | None) -> dict[str, Any]:
    return {"status": "bitwise"} if problem is None else {"status": "differ", **problem}


def check_convert(s: Subject, dtype: Any) -> dict[str, Any]:
    ref, _ = s.eager(dtype)
    amp = s.convert(dtype, train=False)
    out, _ = s.run(amp, census_models.BATCH, grads=False)
    s.amps[dtype] = amp
    return _verdict(compare_outputs(out, ref))


def check_grads(s: Subject, dtype: Any) -> dict[str, Any]:
    if not any(p.requires_grad for p in s.model.parameters()):
        return {"status": "skipped", "reason": "no trainable parameters"}
    ref, ref_g = s.eager(dtype, grads=True)
    if not ref_g:
        return {"status": "skipped", "reason": "eager produced no gradients"}
    amp = s.convert(dtype, train=True)
    out, g = s.run(amp, census_models.BATCH, grads=True)
    return _verdict(compare_outputs(out, ref) or compare_grads(g, ref_g))


def check_batch(s: Subject, dtype: Any) -> dict[str, Any]:
    amp = s.amps.get(dtype)
    if amp is None:
        return {"status": "skipped", "reason": "no module converted at batch 2"}
    for batch in (1, 3):
        ref, _ = s.eager(dtype, batch)
        out, _ = s.run(amp, batch, grads=False)
        problem = compare_outputs(out, ref)
        if problem:
            return {"status": "differ", "batch": batch, **problem}
    return {"status": "bitwise"}


# Dynamo falls back to eager, silently, for a frame recompiled more often than this (each layer's
# frame where a graph break splits a layer loop): raised for the census's backend checks only.
RECOMPILE_LIMIT = 256


def _counting_backend() -> tuple[Callable[..., Any], list[int]]:
    """graphamp's registered dynamo backend (what ``backend="graphamp"`` looks up), counting its
    calls: the number of nodes of each graph it compiled."""
    from torch._dynamo.backends.registry import lookup_backend

    real = lookup_backend("graphamp")
    calls: list[int] = []

    def graphamp_counted(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        calls.append(len(gm.graph.nodes))
        return real(gm, example_inputs, **kwargs)

    return graphamp_counted, calls


def _called(compiled: Callable[..., Any], *, ambient: bool, dtype: Any) -> Callable[..., Any]:
    """``compiled``, called inside ``torch.autocast("cpu", dtype)`` when ``ambient``."""
    import torch

    def call(*a: Any, **k: Any) -> Any:
        if ambient:
            with torch.autocast("cpu", dtype=dtype):
                return compiled(*a, **k)
        return compiled(*a, **k)

    return call


def _backend_run(s: Subject, dtype: Any, *, ambient: bool) -> dict[str, Any]:
    """``torch.compile(model, backend="graphamp", options={"inner": "eager"})`` on the example, called
    inside ``torch.autocast`` when ``ambient``, against eager autocast. An error where graphamp's
    backend was never called: dynamo ran the model eagerly, so equality would prove nothing.
    Skipped, with both errors, where plain ``torch.compile`` fails the same way without graphamp."""
    import torch

    torch._dynamo.reset()
    ref, _ = s.eager(dtype)
    backend, calls = _counting_backend()
    call = _called(torch.compile(s.model, backend=backend, options={"inner": "eager", "dtype": dtype}), ambient=ambient, dtype=dtype)
    limit = max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
    try:
        with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=max(limit * 16, torch._dynamo.config.accumulated_recompile_limit)):
            out, _ = s.run(call, census_models.BATCH, grads=False)
    except Exception as e:
        ours = _error(e)
        if ours["reported"]:  # graphamp's own typed error
            raise
        plain = _plain_compile_error(s, ambient=ambient, dtype=dtype)
        if plain is None:
            raise
        raise Skipped(f"torch.compile itself fails on this model without graphamp ({plain}); "
                      f"with graphamp: {ours['type']}: {ours['message']}") from e
    finally:
        torch._dynamo.reset()
    if not calls:
        return {"status": "error", "type": "BackendNotCalled", "reported": False, "where": "",
                "message": "backend not called: dynamo ran the model eagerly without calling graphamp's backend (a recompile limit, or every frame skipped)"}
    return {**_verdict(compare_outputs(out, ref)), "graphs": len(calls), "graph_nodes": sum(calls)}


def _plain_compile_error(s: Subject, *, ambient: bool, dtype: Any) -> str | None:
    """Where graphamp's backend failed with an error that is not graphamp's: the error of plain
    ``torch.compile(model, backend="eager")`` (dynamo alone, no graphamp) called the same way
    (inside ``torch.autocast`` when ``ambient``, else in fp32), or None where that runs. A model
    dynamo itself cannot compile is no evidence about graphamp's backend: the check is skipped."""
    import torch

    torch._dynamo.reset()
    try:
        s.run(_called(torch.compile(s.model, backend="eager"), ambient=ambient, dtype=dtype), census_models.BATCH, grads=False)
    except Exception as e:
        err = _error(e)
        return f"backend='eager'{' inside torch.autocast' if ambient else ''}: {err['type']}: {err['message']}"
    finally:
        torch._dynamo.reset()
    return None


def check_backend(s: Subject, dtype: Any) -> dict[str, Any]:
    return _backend_run(s, dtype, ambient=False)


def check_backend_autocast(s: Subject, dtype: Any) -> dict[str, Any]:
    return _backend_run(s, dtype, ambient=True)


def _against_eager(s: Subject, amp: Any, dtype: Any, inputs: tuple, what: str) -> dict[str, Any]:
    ref = s.eager_on(dtype, inputs, what)
    out, _ = s.run(amp, None, grads=False, inputs=inputs)
    return _verdict(compare_outputs(out, ref))


PAD_SOURCES = ("input_ids", "input_values")


def padded_mask_inputs(s: Subject) -> tuple[tuple, dict]:
    """The example with a padded ``attention_mask``: row 0 right-padded, row 1 left-padded (a
    quarter of the length each), as a keyword where the example had none. Skipped (raises) where
    the model's forward takes no attention_mask or no sequence input gives it a length."""
    import inspect

    import torch

    args, kwargs = s.inputs(census_models.BATCH)
    params = inspect.signature(s.model.forward).parameters
    if "attention_mask" not in params:
        raise Skipped("forward takes no attention_mask")
    given = kwargs.get("attention_mask")
    if isinstance(given, torch.Tensor):
        if given.dim() != 2:
            raise Skipped(f"the example's attention_mask has shape {tuple(given.shape)}, not (batch, length)")
        length, dtype = given.shape[1], given.dtype
    else:
        source = next((k for k in PAD_SOURCES if isinstance(kwargs.get(k), torch.Tensor)), None)
        if source is None:
            raise Skipped(f"no sequence input ({', '.join(PAD_SOURCES)}) gives the mask its length")
        length, dtype = kwargs[source].shape[1], torch.long
    if length < 2:
        raise Skipped(f"sequence of length {length}")
    mask = torch.ones(census_models.BATCH, length, dtype=dtype)
    pad = max(1, length // 4)
    mask[0, length - pad:] = 0  # right padding
    mask[1, :pad] = 0  # left padding
    return args, {**kwargs, "attention_mask": mask}


def check_inputs(s: Subject, dtype: Any) -> dict[str, Any]:
    """The bf16 module converted on the example, called on other inputs: other values at the same
    shapes, a padded attention mask, a longer input_ids (+5); each case against eager autocast."""
    amp = s.amps.get(dtype)
    if amp is None:
        return {"status": "skipped", "reason": "no module converted on the example"}
    batch = census_models.BATCH

    def values() -> dict[str, Any]:
        return _against_eager(s, amp, dtype, s.inputs(batch, seed=1), "other values")

    def padded_mask() -> dict[str, Any]:
        return _against_eager(s, amp, dtype, padded_mask_inputs(s), "a padded attention mask")

    def longer() -> dict[str, Any]:
        if not s.built.seq_input:
            raise Skipped("the model takes no input_ids as its main input")
        return _against_eager(s, amp, dtype, s.inputs(batch, seq=census_models.SEQ + 5), f"input_ids of length {census_models.SEQ + 5}")

    return _combine({"values": _guarded(values), "padded_mask": _guarded(padded_mask), "longer": _guarded(longer)})


def _load_train(model: Any, state: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        for k, v in model.state_dict(keep_vars=True).items():
            v.copy_(state[k])
    model.train()
    model.zero_grad(set_to_none=True)


def _seed_all(seed: int) -> None:
    """torch's generator, Python's and numpy's global ones (BigBird's random attention blocks and
    wav2vec2's SpecAugment masks draw from numpy in training)."""
    import random

    import numpy as np
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _train_run(model: Any, state: dict[str, Any], call: Callable[..., Any], inputs: tuple) -> tuple[Any, dict[str, Any]]:
    """``call`` on ``inputs`` in train mode from ``state``, seeded right before the call: outputs
    and every parameter's gradient of the census's loss."""
    _load_train(model, state)
    args, kwargs = _clone(inputs)
    _seed_all(0)
    out = call(*args, **kwargs)
    _loss(out).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


def check_dropout(s: Subject, dtype: Any) -> dict[str, Any]:
    """Train mode with the model's own dropout (the other checks zero it), the same seed right
    before each call: outputs and every parameter gradient against eager autocast."""
    import graphamp
    import torch
    from torch import nn

    if not any(p.requires_grad for p in s.model.parameters()):
        return {"status": "skipped", "reason": "no trainable parameters"}
    zeroed = None
    if s.built.dropout_model is not None:  # transformers: the config's dropout, rebuilt
        model, config_p = s.built.dropout_model()
        keys = model.state_dict().keys()
        if keys != s.state.keys():
            return {"status": "skipped", "reason": f"the model built with dropout has other state ({len(keys ^ s.state.keys())} keys differ)"}
    else:  # the modules' own p, as built
        model, config_p = s.model, {}
        zeroed = {n: m for n, m in model.named_modules() if n in s.dropout_p}
        for n, m in zeroed.items():
            m.p = s.dropout_p[n]
    try:
        module_p = {n: m.p for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0}
        info: dict[str, Any] = {"modules": len(module_p), "p": sorted(set(module_p.values()))[:5], "config": config_p}
        if not module_p and not config_p:
            info["note"] = "no dropout in this model"
        inputs = s.inputs(census_models.BATCH)

        def eager(*a: Any, **k: Any) -> Any:
            with torch.autocast("cpu", dtype=dtype):
                return model(*a, **k)

        try:
            ref, ref_g = _train_run(model, s.state, eager, inputs)
        except Exception as e:
            raise EagerFailed(f"eager autocast cannot run (train mode with dropout): {type(e).__name__}: {_first_line(e)[:200]}") from e
        if not ref_g:
            return {"status": "skipped", "reason": "eager produced no gradients", "dropout": info}
        # Eager against itself first: a model that draws from a generator none of the seeds fixes
        # differs from itself, and no difference from graphamp's module would say anything.
        again, again_g = _train_run(model, s.state, eager, inputs)
        if compare_outputs(again, ref) or compare_grads(again_g, ref_g):
            # A first call may change the model (BigBird swaps in a full-attention module for a short
            # sequence, whose construction draws from torch's generator): the later calls then agree.
            ref, ref_g = again, again_g
            again, again_g = _train_run(model, s.state, eager, inputs)
            info["note"] = "the first eager call differs from the later ones: compared with the later ones"
        if compare_outputs(again, ref) or compare_grads(again_g, ref_g):
            return {"status": "skipped", "reason": "eager autocast differs from itself from the same seeds (torch, Python, numpy)", "dropout": info}
        _load_train(model, s.state)
        _seed_all(1)  # another draw than the calls': a module that kept the conversion's draw differs
        amp = graphamp.convert(model, *_clone(inputs), dtype=dtype)
        out, g = _train_run(model, s.state, amp, inputs)
        return {**_verdict(compare_outputs(out, ref) or compare_grads(g, ref_g)), "dropout": info}
    finally:
        for m in (zeroed or {}).values():
            m.p = 0.0
        s.reset()


def _verify_program(s: Subject, program: Any, dtype: Any, inputs: tuple) -> dict[str, Any]:
    import graphamp

    s.reset()
    args, kwargs = _clone(inputs)
    problem = graphamp.verify_export(program, s.model, args, kwargs, dtype=dtype)
    if not problem:
        return {"status": "bitwise"}
    name = re.match(r"(output(?: leaf \d+)?\S*)", problem)
    return {"status": "differ", "first": problem[:300], "max_abs_diff": None, "names": [name.group(1)] if name else []}


def check_export(s: Subject, dtype: Any) -> dict[str, Any]:
    """``graphamp.export``'s program on the example and on other values at its shapes,
    ``graphamp.verify_export`` against eager autocast (eval, no_grad)."""
    import graphamp

    s.reset()
    program = graphamp.export(s.model, *s.inputs(census_models.BATCH), dtype=dtype)
    batch = census_models.BATCH
    return _combine({
        "example": _guarded(lambda: _verify_program(s, program, dtype, s.inputs(batch))),
        "values": _guarded(lambda: _verify_program(s, program, dtype, s.inputs(batch, seed=1))),
    })


def build_subject(name: str, record: Record) -> Subject | None:
    """The first build of ``name`` whose eager autocast runs at bf16, else None (eager cannot run)."""
    import torch

    failures = []
    record.data["builder"] = census_models.builder_id()
    for attempt in range(census_models.attempts(name)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built = census_models.build(name, attempt)
                s = Subject(built)
                s.eager(torch.bfloat16)
        except census_models.NotApplicable:
            continue
        except Exception as e:  # construction or the eager run: "eager cannot run", graphamp untried
            e = e.__cause__ if isinstance(e, EagerFailed) and e.__cause__ else e
            failures.append(f"{type(e).__name__}: {_first_line(e)[:200]}")
            continue
        record.data.update({"class": built.cls, "note": built.note, "params": sum(p.numel() for p in s.model.parameters())})
        record.data["eager"] = {"status": "ok", "attempt": attempt}
        return s
    record.data["eager"] = {"status": "error", "message": failures[-1] if failures else "no build applies", "attempts": failures}
    return None


CHECK_FUNCS: dict[str, Callable[[Subject, Any], dict[str, Any]]] = {
    "convert_bf16": lambda s, _: check_convert(s, _bf16()),
    "convert_fp16": lambda s, _: check_convert(s, _fp16()),
    "grads_bf16": lambda s, _: check_grads(s, _bf16()),
    "batch": lambda s, _: check_batch(s, _bf16()),
    "backend": lambda s, _: check_backend(s, _bf16()),
    "inputs": lambda s, _: check_inputs(s, _bf16()),
    "dropout": lambda s, _: check_dropout(s, _bf16()),
    "export": lambda s, _: check_export(s, _bf16()),
    "backend_autocast": lambda s, _: check_backend_autocast(s, _bf16()),
}


def _bf16() -> Any:
    import torch

    return torch.bfloat16


def _fp16() -> Any:
    import torch

    return torch.float16


def run_model(name: str, checks: tuple[str, ...], path: Path | None = None, *, record: Record | None = None) -> dict[str, Any]:
    """Every check of ``checks`` on one model; the record (also written to ``path`` as it goes)."""
    import torch

    census_models.enable_census_site()
    record = record or Record(name, path)
    record.data["requested"] = list(checks)
    record.save()
    s = build_subject(name, record)
    if s is not None:
        # The batch and inputs checks reuse the bf16 module; convert it first even when only they are asked for.
        order = [c for c in CHECKS if c in checks]
        if any(c in order for c in NEEDS_AMP) and "convert_bf16" not in order:
            order.insert(0, "convert_bf16")
        for check in order:
            record.data["current"] = check
            record.save()
            result = _guarded(lambda check=check: CHECK_FUNCS[check](s, None))
            if check in checks:
                record.data["checks"][check] = result
        torch._dynamo.reset()
    record.data["status"] = "done"
    record.data.pop("current", None)
    record.save()
    return record.data


# ---------------------------------------------------------------- the runner


def _version(pkg: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """The CPU class a run is on: its model, bf16/fp16 flags and whether each is native."""
    import torch

    from graphamp import hardware

    cap = hardware.capability("cpu")
    return {
        "cpu": hardware.cpu_model(),
        "cpu_flags": sorted(hardware.cpu_flags()),
        "native": {"bf16": cap.native(torch.bfloat16), "fp16": cap.native(torch.float16)},
    }


def header() -> dict[str, Any]:
    import torch

    census_models.enable_census_site()
    return {
        "header": True,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "graphamp_commit": _git_commit(),
        # Files under graphamp/ with uncommitted edits when the run started (a shared checkout).
        "graphamp_dirty": _git_dirty(),
        # The census builder (census_models.builder_id) when the run started; each row records its own.
        "builder": census_models.builder_id(),
        "versions": {p: _version(p) for p in ("torch", "transformers", "timm", "diffusers", "torchvision")},
        "python": platform.python_version(),
        **machine(),
        "threads": torch.get_num_threads(),
        # What "reported" means in this file's records (the module docstring): "named" since issue 38.
        "reported_rule": REPORTED_RULE,
    }


def resumed_timeout(given: float | None, head: dict[str, Any] | None) -> float:
    """The time limit per model: ``--timeout`` where given, else the one the file's header records
    (a resumed run keeps its limit), else 120 s."""
    if given is not None:
        return given
    return float((head or {}).get("timeout") or DEFAULT_TIMEOUT)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=10, check=False).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _git_dirty() -> list[str]:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "graphamp"], cwd=HERE.parent, capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line[3:] for line in out.splitlines()]


def read_results(path: Path) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """The file's first header and the last record per model (a resumed run may repeat one)."""
    head, records = None, {}
    if not path.exists():
        return None, {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("header"):
            head = head or row
        elif "model" in row:
            records[row["model"]] = row
    return head, records


# What a record says about why it did not finish (run_one, diagnose_timeout).
_UNFINISHED = ("timeout_in", "crash_in", "kind", "cpu_share", "stack_changed", "stack", "stacks")


def merge_results(out: Path, newer: Path) -> int:
    """Update ``out`` with a re-run's rows (``newer``): each check the re-run made replaces that check
    of the model's row, which records the re-run (date, commit, checks) under ``rerun``; a re-run
    that timed out brings the checks it finished and its own time-out. A model eager could not run
    before takes the re-run's whole row. Returns how many rows changed. Rows of models the re-run
    could not build or run stay as they were."""
    head, records = read_results(out)
    new_head, new_records = read_results(newer)
    stamp = {"date": (new_head or {}).get("date"), "commit": (new_head or {}).get("graphamp_commit")}
    changed = 0
    for model, row in new_records.items():
        old = records.get(model)
        if row.get("eager", {}).get("status") != "ok" or not row.get("checks"):
            continue
        if old is None:
            records[model] = row
            changed += 1
            continue
        if old.get("eager", {}).get("status") != "ok" and row.get("status") == "done":
            records[model] = {**row, "rerun": [*old.get("rerun", []), {**stamp, "checks": sorted(row.get("checks", {}))}]}
            changed += 1
            continue
        merged = dict(old)
        # The re-run's build (a changed shrink builds another size) is the one its checks ran on.
        # A re-run of a model eager could not run before (another builder) brings its eager status.
        merged.update({k: row[k] for k in ("class", "note", "params", "eager", "builder") if k in row})
        merged["checks"] = {**old.get("checks", {}), **row.get("checks", {})}
        merged["requested"] = sorted(set(old.get("requested", CHECKS)) | set(row.get("requested", [])), key=CHECKS.index)
        if set(merged["requested"]) <= set(merged["checks"]):  # every check has a result now
            merged["status"] = "done"
            for k in _UNFINISHED:
                merged.pop(k, None)
        elif row.get("status") in ("timeout", "crash"):  # the re-run's own time-out explains what is still missing
            for k in _UNFINISHED:
                merged.pop(k, None)
            merged.update({k: row[k] for k in ("status", *_UNFINISHED) if k in row})
        merged["rerun"] = [*old.get("rerun", []), {**stamp, "checks": sorted(row.get("checks", {}))}]
        records[model] = merged
        changed += 1
    lines = [json.dumps(head)] if head else []
    lines += [json.dumps(r) for r in records.values()]
    out.write_text("\n".join(lines) + "\n")
    return changed


def _worker_command(name: str, checks: tuple[str, ...], result: Path, threads: int, stack_file: Path | None = None) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--checks", ",".join(checks), "--result", str(result), "--threads", str(threads)]
    return cmd + (["--stack-file", str(stack_file)] if stack_file else [])


# ---------------------------------------------------------------- time-outs explained

# The worker writes this line to its stack file once SIGUSR1 dumps its stack there (before that,
# SIGUSR1's default action would kill it).
STACK_READY = "census: stack dumps on SIGUSR1"
# Seconds between the two stacks of a timed-out worker, and the share of one core it must have
# used meanwhile to count as working ("slow" or "busy") rather than stuck ("hang").
SAMPLE_SECONDS = 4.0
BUSY_SHARE = 0.1
STACK_LINES = 40


def listen_for_stack_dumps(path: str | Path) -> Any:
    """In a worker: SIGUSR1 dumps every thread's Python stack to ``path`` (faulthandler), which
    works in C code too; crashes dump to stderr. Returns the open file (keep it alive)."""
    import faulthandler

    faulthandler.enable()
    f = open(path, "a")  # noqa: SIM115 - open for the process's life, as faulthandler needs
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    f.write(STACK_READY + "\n")
    f.flush()
    return f


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of ``pid`` and its waited-for children (/proc/<pid>/stat), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def proc_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (state T: SIGSTOP, or a debugger), not running or waiting."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] in ("T", "t")


# A poll of the worker that returns this many seconds later than it slept: the census itself was
# stopped (or the machine suspended) meanwhile, and that time is not the worker's.
STOPPED_GAP = 5.0


def _dump_stack(pid: int, path: Path, wait: float = 2.0) -> str:
    """Ask the worker for its stacks (SIGUSR1) and return what it wrote; "" if nothing came."""
    before = path.stat().st_size if path.exists() else 0
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return ""
    deadline, size = time.monotonic() + wait, before
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = path.stat().st_size if path.exists() else 0
        if now > before and now == size:  # written, and no longer growing
            break
        size = now
    with open(path, errors="replace") as f:
        f.seek(before)
        return f.read()


def _stack_key(dump: str) -> list[str]:
    # The frames only: "File ..., line N in f" lines (thread headers name addresses that stay put).
    return [line.strip() for line in dump.splitlines() if line.strip().startswith("File ")]


def diagnose_timeout(pid: int, stack_file: Path | None, sample: float = SAMPLE_SECONDS) -> dict[str, Any]:
    """Why a worker past its time limit is still running: two stack dumps ``sample`` seconds apart
    and its CPU time in between. "hang" when it used little CPU meanwhile; "busy" when it used the
    CPU but its stack did not change (a long native call, or a loop over identical layers: the
    frames name no layer, so a longer limit decides); "slow" otherwise (it is working, and a longer
    limit may let it finish)."""
    ready = stack_file is not None and stack_file.exists() and STACK_READY in stack_file.read_text(errors="replace")[:200]
    cpu0, t0 = proc_cpu_seconds(pid), time.monotonic()
    first = _dump_stack(pid, stack_file) if ready else ""
    time.sleep(max(0.0, sample - (time.monotonic() - t0)))
    cpu1, t1 = proc_cpu_seconds(pid), time.monotonic()
    second = _dump_stack(pid, stack_file) if ready else ""
    try:  # frozen where the stack was taken: the record read next is the one the stack belongs to
        os.killpg(pid, signal.SIGSTOP)
    except (ProcessLookupError, PermissionError):
        pass
    busy = (cpu1 - cpu0) / (t1 - t0) if cpu0 is not None and cpu1 is not None else None
    same = bool(first) and _stack_key(first) == _stack_key(second)
    kind = timeout_kind(None if busy is None else round(busy, 2), None if not first else not same)
    lines = second.strip().splitlines() or first.strip().splitlines()
    return {
        "kind": kind,
        "cpu_share": None if busy is None else round(busy, 2),  # of one core, over the sample
        "stack_changed": None if not first else not same,
        # faulthandler prints the most recent call first: these are the innermost frames.
        "stack": lines[:STACK_LINES] if lines else ["no stack: the worker had not registered its SIGUSR1 dump yet"],
    }


def run_limited(cmd: list[str], timeout: float, log: Path, stack_file: Path | None = None, sample: float = SAMPLE_SECONDS) -> dict[str, Any]:
    """Run ``cmd`` (its own session, output to ``log``) for at most ``timeout`` seconds.

    Returns ``{"code": exit code or None, "cpu_s": its CPU seconds (from wait4, children included)}``,
    plus ``diagnose_timeout``'s findings where it timed out (then it is killed, group and all).
    The limit counts the time both ran: time the worker spent stopped (``kill -STOP``), or the
    census itself was stopped, moves the deadline on, so pausing a run makes no time-outs.
    """
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline, pause, found = time.monotonic() + timeout, 0.02, None
    polled = time.monotonic()
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        now = time.monotonic()
        if now - polled > pause + STOPPED_GAP or proc_stopped(proc.pid):
            deadline += now - polled
        polled = now
        if now >= deadline:
            found = diagnose_timeout(proc.pid, stack_file, sample)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    result: dict[str, Any] = {"code": None if found else proc.returncode, "cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}
    if found:
        result.update(found)
    return result


def run_one(name: str, checks: tuple[str, ...], timeout: float, threads: int) -> dict[str, Any]:
    """``name`` in a subprocess with a time limit; a killed or crashed worker keeps its finished
    checks. A timed-out worker's record says whether it hung or was slow (``diagnose_timeout``)."""
    with tempfile.TemporaryDirectory(prefix="census-") as tmp:
        result = Path(tmp) / "result.json"
        log = Path(tmp) / "log.txt"
        stacks = Path(tmp) / "stacks.txt"
        commit = _git_commit()
        ran = run_limited(_worker_command(name, checks, result, threads, stacks), timeout, log, stacks)
        code = ran["code"]
        data = json.loads(result.read_text()) if result.exists() else {"model": name, "family": name.split("/")[0], "checks": {}}
        data["cpu_s"] = ran["cpu_s"]  # the worker's CPU seconds, all threads (its checks': cpu_s each)
        data["commit"] = commit
        if code is None:
            data["status"] = "timeout"
            data["timeout_in"] = data.pop("current", None)
            data["seconds"] = timeout
            data.update({k: ran[k] for k in ("kind", "cpu_share", "stack_changed", "stack")})
        elif data.get("status") != "done":
            data["status"] = "crash"
            data["crash_in"] = data.pop("current", None)
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            data["crash"] = f"exit {code}: " + " | ".join(t[:200] for t in tail)
        return data


class ModelTimeout(BaseException):
    """A model's time is up (in-process runs); a BaseException so no check's guard swallows it."""


def _alarm(signum: int, frame: Any) -> None:
    raise ModelTimeout()


def run_in_process(plan: dict[str, tuple[str, ...]], out: Path, timeout: float) -> None:
    """Each model of ``plan`` (name -> checks) in this process, one after another, SIGALRM-limited.

    Cheaper than a process per model (transformers is imported once); the CI sample uses it from a
    subprocess of its own, so the census-only packages never reach the test process.
    """
    census_models.enable_census_site()
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for name, checks in plan.items():
            signal.setitimer(signal.ITIMER_REAL, timeout)
            record = Record(name, None)
            try:
                data = run_model(name, checks, record=record)
            except ModelTimeout:
                record.save()
                data = record.data
                data["status"], data["timeout_in"] = "timeout", data.pop("current", None)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            with open(out, "a") as f:
                f.write(json.dumps(data) + "\n")
            # What a model leaves alive (imported model code, torch's caches) is collected once and
            # frozen out of the collector's sight: full collections otherwise walk it again and again.
            gc.collect()
            gc.freeze()
    finally:
        signal.signal(signal.SIGALRM, old)


def select(names: list[str], only: str | None, shard: str | None, sample: float | None, seed: int) -> list[str]:
    if only:
        names = [n for n in names if re.search(only, n)]
    if sample is not None:
        rng = random.Random(seed)
        names = [n for n in names if not n.startswith("hf/") or rng.random() < sample]
    if shard:
        i, n = (int(x) for x in shard.split("/"))
        names = names[i::n]
    return names


# The libraries a resumed run must share with the results file (read without the census site,
# which would reach this process's sys.path and every process it spawns).
_SAME_VERSIONS = ("torch", "transformers")


def check_resumable(head: dict[str, Any] | None, path: Path, allow_mixed: bool) -> None:
    """Exit unless the results file ``path`` (header ``head``) was written at this commit, on this
    machine class with these libraries: one table, one commit, one machine. ``allow_mixed`` resumes
    anyway (each record keeps its own ``commit``)."""
    if head is None or allow_mixed:
        return
    here = _git_commit()
    there = head.get("graphamp_commit")
    if there != here:
        sys.exit(f"{path} was written at graphamp commit {there}, this is {here}: the table must come from one commit. "
                 "Start another --out, or pass --allow-mixed to append anyway (each record keeps its commit).")
    # Another CPU class would mix two machines' eager kernels in one table; other versions, two torches.
    now = {**machine(), **{f"versions.{p}": _version(p) for p in _SAME_VERSIONS}}
    then = {**head, **{f"versions.{p}": v for p, v in (head.get("versions") or {}).items()}}
    changed = [f"{k}: {then[k]} there, {now[k]} here" for k in now if k in then and then[k] != now[k]]
    if changed:
        sys.exit(f"{path} was written on another machine class or with other libraries ({'; '.join(changed)}): the "
                 "table must come from one machine. Start another --out, or pass --allow-mixed to append anyway.")


def _run_models(plan: dict[str, tuple[str, ...]], timeout: float, jobs: int, threads: int, out: Path) -> None:
    """Each model of ``plan`` (name -> checks) in a worker of its own, ``jobs`` at a time; each
    record appended to ``out`` as it comes."""
    names = list(plan)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(run_one, n, plan[n], timeout, threads): n for n in names}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            data = fut.result()
            with open(out, "a") as f:
                f.write(json.dumps(data) + "\n")
            print(f"[{i}/{len(names)}] {data['model']}: {_one_line(data)}", flush=True)


def timeout_kind(cpu_share: float | None, stack_changed: bool | None, recorded: str | None = None) -> str:
    """A time-out's kind from what was measured (a record written by an older rule is read by this one):
    "hang" with little CPU, "busy" with the CPU used and the stack unchanged, "slow" otherwise."""
    if cpu_share is None and stack_changed is None:
        return recorded or "unexplained"
    if cpu_share is not None and cpu_share < BUSY_SHARE:
        return "hang"
    return "busy" if stack_changed is False else "slow"


def _kind(record: dict[str, Any]) -> str:
    return timeout_kind(record.get("cpu_share"), record.get("stack_changed"), record.get("kind"))


def cannot_run_elsewhere(records: dict[str, dict[str, Any]], builder: str) -> list[str]:
    """The models eager could not run on any build of another builder than ``builder`` (a row
    without one predates the field): a later builder may build them."""
    return [n for n, r in records.items() if r.get("eager", {}).get("status") == "error" and r.get("builder") != builder]


def slow_timeouts(records: dict[str, dict[str, Any]], limit: float) -> list[str]:
    """The models whose last record timed out while using the CPU ("slow" or "busy"), under a limit below ``limit``."""
    return [n for n, r in records.items() if r.get("status") == "timeout" and _kind(r) in ("slow", "busy") and (r.get("seconds") or 0) < limit]


def run_census(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.resume and out.exists():
        sys.exit(f"{out} exists: pass --resume to continue it, or --out another file")
    head, done = read_results(out) if args.resume else (None, {})
    if args.resume:
        check_resumable(head, out, args.allow_mixed)
    if args.retry_unfinished:
        done = {n: r for n, r in done.items() if r.get("status") == "done"}
    if args.retry_cannot_run:
        retry = set(cannot_run_elsewhere(done, census_models.builder_id()))
        done = {n: r for n, r in done.items() if n not in retry}
    selected = select(census_models.population(), args.only, args.shard, args.sample, args.seed)
    names = [n for n in selected if n not in done]
    checks = tuple(args.checks.split(","))
    args.timeout = resumed_timeout(args.timeout, head)
    if not out.exists() or out.stat().st_size == 0:
        with open(out, "a") as f:
            f.write(json.dumps({**header(), "timeout": args.timeout}) + "\n")
    print(f"census: {len(names)} models to run ({len(done)} already in {out}), checks {','.join(checks)}, {args.jobs} job(s), {args.timeout:.0f} s each", flush=True)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    _run_models(dict.fromkeys(names, checks), args.timeout, args.jobs, threads, out)
    if args.rerun_slow:
        _, records = read_results(out)
        wanted = set(selected)
        slow = [n for n in slow_timeouts(records, args.rerun_slow) if n in wanted]
        print(f"census: {len(slow)} slow time-outs to run again with {args.rerun_slow:.0f} s each", flush=True)
        # The re-run's record comes later in the file, so it is the model's record (read_results).
        _run_models({n: tuple(records[n].get("requested") or checks) for n in slow}, args.rerun_slow, args.jobs, threads, out)
    print_summary(out, markdown=args.markdown)


def _one_line(data: dict[str, Any]) -> str:
    if data.get("eager", {}).get("status") == "error":
        return "eager cannot run"
    parts = [f"{c}={r['status']}" for c, r in data.get("checks", {}).items()]
    if data.get("status") in ("timeout", "crash"):
        parts.append(f"{data['status']} in {data.get('timeout_in') or data.get('crash_in')}")
    return " ".join(parts) + f" ({data.get('seconds', 0):.0f} s)"


# ---------------------------------------------------------------- the summary

KINDS = ("bitwise", "differ-silent", "differ-reported", "error-silent", "error-reported", "skipped", "timeout/crash")


def kind(result: dict[str, Any] | None) -> str:
    if result is None:
        return "timeout/crash"
    st = result["status"]
    if st in ("differ", "error"):
        return f"{st}-{'reported' if result.get('reported') else 'silent'}"
    return st


def normalize(message: str) -> str:
    """A cause key: numbers, quoted names and shapes replaced, so one cause groups many models."""
    m = re.sub(r"0x[0-9a-f]+", "ADDR", message)
    # The model's own class names, not exception types.
    m = re.sub(r"\b(?!\w*(?:Error|Exception|Warning)\b)[A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+\b", "Cls", m)
    m = re.sub(r"\b\w+(?:\.\w+){2,}\b", "name", m)  # parameter and module paths
    m = re.sub(r"(?<!\w)'[^']*'|\"[^\"]*\"|`[^`]*`", "'…'", m)
    m = re.sub(r"\[[^\]]*\]|\([^)]*\)", "[…]", m)
    m = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", m)
    return m[:140]


def cause(check: str, result: dict[str, Any] | None, data: dict[str, Any]) -> str:
    if result is None:
        how = f" ({_kind(data)})" if data.get("status") == "timeout" else ""
        return f"{data.get('status', 'unfinished')}{how} in {data.get('timeout_in') or data.get('crash_in') or '?'}"
    if result["status"] == "error":
        return f"{result['type']}: {normalize(result['message'])}"
    if result["status"] == "differ":
        what = "dtype" if result.get("dtype_mismatch") else ("grad" if str(result.get("first", "")).startswith("grad") else "value")
        where = f" on {result['case']}" if result.get("case") else ""
        return f"differ ({what}){where}{', named by a graphamp warning' if result.get('reported') else ''}"
    return f"skipped: {normalize(result.get('reason', ''))}"


def summarize(records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    runs = {n: r for n, r in records.items() if r.get("eager", {}).get("status") == "ok"}
    cannot = {n: r for n, r in records.items() if n not in runs}
    table: dict[str, Counter] = {}
    causes: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for check in CHECKS:
        counts: Counter = Counter()
        for n, r in sorted(runs.items()):
            res = r.get("checks", {}).get(check)
            if check not in r.get("requested", CHECKS) or (res is None and r.get("status") == "done"):
                continue  # not asked for in that run
            k = kind(res)
            counts[k] += 1
            if k not in ("bitwise",):
                causes[cause(check, res, r)][check].append(n)
        table[check] = counts
    silent = {n for n, r in runs.items() if any(kind(res).endswith("-silent") for res in r.get("checks", {}).values())}
    reported = {n for n, r in runs.items() if any(kind(res).endswith("-reported") for res in r.get("checks", {}).values())}
    timeouts = Counter(_kind(r) for r in records.values() if r.get("status") == "timeout")
    return {"models": len(records), "eager_runs": len(runs), "eager_cannot": len(cannot), "table": table, "causes": causes,
            "cannot": Counter(normalize(r.get("eager", {}).get("message") or r.get("status", "?"))[:90] for r in cannot.values()),
            "silent_models": sorted(silent), "reported_models": sorted(reported), "timeouts": timeouts}


def _cell(n: int, total: int) -> str:
    return f"{n} ({100 * n / total:.0f}%)" if n and total else str(n)


def print_summary(path: Path, *, markdown: bool = False, file: Any = None) -> None:
    file = file or sys.stdout
    head, records = read_results(path)
    s = summarize(records)
    if head:
        v = head.get("versions", {})
        dirty = f" + uncommitted edits to {len(head['graphamp_dirty'])} files" if head.get("graphamp_dirty") else ""
        print(f"census of {head.get('date')} on graphamp {head.get('graphamp_commit')}{dirty}: torch {v.get('torch')}, transformers {v.get('transformers')}, "
              f"timm {v.get('timm')}, diffusers {v.get('diffusers')}; CPU {head.get('cpu')} (native bf16: {head.get('native', {}).get('bf16')}, "
              f"fp16: {head.get('native', {}).get('fp16')}; flags {', '.join(head.get('cpu_flags', [])) or 'none of avx512_bf16/amx_bf16/avx512_fp16'})", file=file)
    fam = Counter(r.get("family") for r in records.values())
    print(f"{s['models']} models ({', '.join(f'{k} {v}' for k, v in sorted(fam.items()))}); eager autocast runs on {s['eager_runs']}, "
          f"cannot run on {s['eager_cannot']} (counted apart)", file=file)
    if head is not None and head.get("reported_rule") != REPORTED_RULE:
        print("(this file predates the named rule: its \"reported\" counts any graphamp warning, and an error after one)", file=file)
    if markdown:
        print(markdown_table(s), file=file)
    else:
        n = s["eager_runs"]
        print(f"{'check':16s} " + " ".join(f"{k:>16s}" for k in KINDS) + f"   (% of the {n} models eager runs)", file=file)
        for check, counts in s["table"].items():
            print(f"{check:16s} " + " ".join(f"{_cell(counts.get(k, 0), n):>16s}" for k in KINDS), file=file)
    if not markdown:  # the markdown table says both below itself
        print(f"\nmodels with a silent difference or error in any check: {len(s['silent_models'])}; with one graphamp reported: "
              f"{len(s['reported_models'])} (reported: a typed graphamp error, or a graphamp warning naming what differs)", file=file)
    if s["timeouts"] and not markdown:
        print("time-outs: " + ", ".join(f"{k} {v}" for k, v in sorted(s["timeouts"].items())) +
              " (hang: little CPU; busy: working, the same stack twice; slow: working; --rerun-slow LIMIT runs slow and busy ones again)", file=file)
    print("\nfailures by cause (check: models):", file=file)
    for c, per_check in sorted(s["causes"].items(), key=lambda kv: -sum(len(v) for v in kv[1].values())):
        if c.startswith("skipped"):
            continue
        total = sum(len(v) for v in per_check.values())
        print(f"- {c} [{total}]", file=file)
        for check, models in per_check.items():
            shown = ", ".join(m.split("/", 1)[1] if m.startswith("hf/") else m for m in models[:25])
            print(f"    {check}: {shown}{' …' if len(models) > 25 else ''}", file=file)
    if s["cannot"]:
        print("\neager cannot run (model or inputs not buildable generically), top reasons:", file=file)
        for msg, n in s["cannot"].most_common(12):
            print(f"- [{n}] {msg}", file=file)


def markdown_table(s: dict[str, Any], *, named_rule: bool = True) -> str:
    """The summary as markdown: one row per check that ran (the checks this results file holds no
    result of are named below the table, not shown as zeros). ``named_rule``: the file counts a
    difference as reported only where graphamp named it; else it used the older, looser rule (any
    graphamp warning), which the text says."""
    n = s["eager_runs"]
    ran = {check: counts for check, counts in s["table"].items() if any(counts.get(k, 0) for k in KINDS)}
    lines = [f"| of {n} models eager runs (% of them) | bitwise | differ, silent | differ, reported | error, silent | error, reported | skipped | timeout/crash |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for check, counts in ran.items():
        lines.append(f"| {check} | " + " | ".join(_cell(counts.get(k, 0), n) for k in KINDS) + " |")
    lines.append("")
    missing = [check for check in s["table"] if check not in ran]
    if missing:
        lines.append(f"Not run in this results file: {', '.join(missing)}.")
    rule = ("a typed graphamp error, or a graphamp warning naming the differing output or gradient" if named_rule else
            "counted by the older rule: a typed graphamp error, or any graphamp warning other than the emulated-precision one")
    lines.append(f"Silent (differ or error graphamp did not report): {len(s['silent_models'])} models; reported ({rule}): "
                 f"{len(s['reported_models'])} models.")
    if s["timeouts"]:
        lines.append("Time-outs: " + ", ".join(f"{k} {v}" for k, v in sorted(s["timeouts"].items())) +
                     " (hang: little CPU at the limit; busy: working, the same Python stack twice; slow: working).")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON-lines results file (default %(default)s)")
    p.add_argument("--resume", action="store_true", help="skip models already in --out and append")
    p.add_argument("--retry-unfinished", action="store_true", help="with --resume, run again the models that timed out or crashed")
    p.add_argument("--retry-cannot-run", action="store_true", help="with --resume, run again the models eager could not run with another census builder")
    p.add_argument("--only", help="regex over model names (hf/bert, timm/resnet18, diffusers/dit)")
    p.add_argument("--shard", help="i/n: every n-th model from the i-th")
    p.add_argument("--sample", type=float, help="keep this fraction of the transformers models (seeded), all timm/diffusers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checks", default=",".join(CHECKS), help="comma-separated, from " + ",".join(CHECKS))
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: cores / jobs)")
    p.add_argument("--timeout", type=float, help=f"seconds per model (default: the resumed file's, else {DEFAULT_TIMEOUT:.0f})")
    p.add_argument("--summary", metavar="FILE", help="only print the summary of a results file")
    p.add_argument("--merge", metavar="FILE", help="update --out with a re-run's results file (per check), then exit")
    p.add_argument("--markdown", action="store_true", help="the summary table as markdown")
    p.add_argument("--list", action="store_true", help="print the selected model names and exit")
    p.add_argument("--ci-sample", action="store_true", help="the CI sample (census_sample.py), each model with its own checks")
    p.add_argument("--in-process", action="store_true", help="run the models in this process, one after another (CI sample)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--stack-file", help=argparse.SUPPRESS)
    p.add_argument("--rerun-slow", type=float, metavar="LIMIT", help="then run again, with this time limit (s), the models that timed out while working (kinds slow and busy)")
    p.add_argument("--allow-mixed", action="store_true", help="with --resume, append to a results file written at another graphamp commit")
    args = p.parse_args(argv)
    bad = set(args.checks.split(",")) - set(CHECKS)
    if bad:
        p.error(f"unknown checks {sorted(bad)}; choose from {','.join(CHECKS)}")
    if args.worker:
        _worker(args)
    elif args.merge:
        print(f"census: {merge_results(Path(args.out), Path(args.merge))} rows of {args.out} updated from {args.merge}")
    elif args.summary:
        print_summary(Path(args.summary), markdown=args.markdown)
    elif args.in_process:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        warnings.filterwarnings("ignore")  # each check records graphamp's own warnings
        # Before the plan imports transformers: its timm-backed models (DETR's TimmBackbone) look
        # for timm when first imported.
        census_models.enable_census_site()
        names = select(list(_plan(args)), args.only, args.shard, None, args.seed)
        run_in_process({n: _plan(args)[n] for n in names}, Path(args.out), resumed_timeout(args.timeout, None))
    elif args.list:
        print("\n".join(select(census_models.population(), args.only, args.shard, args.sample, args.seed)))
    else:
        run_census(args)


def _plan(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    if args.ci_sample:
        import census_sample

        return dict(census_sample.SAMPLE)
    checks = tuple(args.checks.split(","))
    return {n: checks for n in census_models.population()}


def _worker(args: argparse.Namespace) -> None:
    if args.stack_file:
        args.stack_fd = listen_for_stack_dumps(args.stack_file)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    run_model(args.worker, tuple(args.checks.split(",")), Path(args.result))


if __name__ == "__main__":
    main()
