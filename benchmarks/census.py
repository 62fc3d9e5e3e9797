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

A check ends ``bitwise``, ``differ`` (max abs diff, first differing output or gradient, dtype
mismatches), ``error`` (type and first line) or ``skipped`` (why). A difference or error graphamp
itself reported (a typed graphamp error, or a graphamp warning other than the emulated-precision
one) is "reported"; any other is "silent". NaN positions count as equal when both sides have them.

    scripts/census                                   # everything, resumable: --resume
    scripts/census --only 'timm/|diffusers/' --jobs 1
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

CHECKS = ("convert_bf16", "convert_fp16", "grads_bf16", "batch", "backend")
DEFAULT_OUT = HERE / "results" / "census.jsonl"


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
    first, worst = None, 0.0
    for (p, a), (_, b) in zip(g, w):
        if isinstance(b, torch.Tensor):
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
        elif a != b:
            first = first or p
    if first is None and not dtypes:
        return None
    return {"first": first or dtypes[0].split(":")[0], "max_abs_diff": worst, "dtype_mismatch": dtypes[:5]}


def compare_grads(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any] | None:
    if got.keys() != want.keys():
        missing = sorted(set(got) ^ set(want))
        return {"first": f"grad set differs: {missing[:3]}", "max_abs_diff": None}
    bad = [n for n in want if not _same(got[n], want[n])]
    if not bad:
        return None
    return {"first": f"grad {bad[0]}", "max_abs_diff": max(_diff(got[n], want[n]) for n in bad), "differing": len(bad), "of": len(want)}


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


def _graphamp_warnings(caught: Iterable[warnings.WarningMessage]) -> list[str]:
    return [f"{w.category.__name__}: {str(w.message).strip().splitlines()[0][:200]}" for w in caught if w.category.__module__.startswith("graphamp")]


def _reports(ws: list[str]) -> bool:
    # The emulated-precision warning is about speed; every other graphamp warning reports a problem.
    return any(not w.startswith("EmulatedPrecisionWarning") for w in ws)


class EagerFailed(Exception):
    """Eager autocast itself cannot run this check (fp16 kernels, a backward): skipped, not graphamp's."""


class Subject:
    """A built model, its pristine state, and eager autocast references computed once each."""

    def __init__(self, built: census_models.Built) -> None:
        from torch import nn

        self.built = built
        self.model = built.model
        # Train mode must be deterministic for the gradient check: dropout modules the config did
        # not reach (timm's classifier drop_rate, hard-coded nn.Dropout) get p=0 too.
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

    def inputs(self, batch: int) -> tuple[tuple, dict]:
        return self.built.make_inputs(batch)

    def run(self, call: Callable[..., Any], batch: int, *, grads: bool) -> tuple[Any, dict[str, Any] | None]:
        import torch

        self.reset(train=grads)
        torch.manual_seed(0)  # any randomness left in the model draws the same on both sides
        args, kwargs = self.inputs(batch)
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

    def convert(self, dtype: Any, *, train: bool) -> Any:
        import graphamp

        self.reset(train=train)
        args, kwargs = self.inputs(census_models.BATCH)
        return graphamp.convert(self.model, args, kwargs, dtype=dtype)


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn()
        except EagerFailed as e:
            result = {"status": "skipped", "reason": str(e)}
        except Exception as e:  # the guard: one failing check never stops the others
            result = _error(e)
    ws = _graphamp_warnings(caught)
    if ws:
        result["warnings"] = sorted(set(ws))[:5]
    if result["status"] == "differ":
        result["reported"] = _reports(ws)
    elif result["status"] == "error":
        result["reported"] = result["reported"] or _reports(ws)
    result["seconds"] = round(time.perf_counter() - start, 2)
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


def check_backend(s: Subject, dtype: Any) -> dict[str, Any]:
    import torch

    torch._dynamo.reset()
    ref, _ = s.eager(dtype)
    compiled = torch.compile(s.model, backend="graphamp", options={"inner": "eager", "dtype": dtype})
    try:
        out, _ = s.run(compiled, census_models.BATCH, grads=False)
    finally:
        torch._dynamo.reset()
    return _verdict(compare_outputs(out, ref))


def build_subject(name: str, record: Record) -> Subject | None:
    """The first build of ``name`` whose eager autocast runs at bf16, else None (eager cannot run)."""
    import torch

    failures = []
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
        # The batch check reuses the bf16 module; convert it first even when only batch is asked for.
        order = [c for c in CHECKS if c in checks]
        if "batch" in order and "convert_bf16" not in order:
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


def header() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    from graphamp import hardware

    census_models.enable_census_site()

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    cap = hardware.capability("cpu")
    flags = hardware.cpu_flags()
    return {
        "header": True,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "graphamp_commit": _git_commit(),
        # Files under graphamp/ with uncommitted edits when the run started (a shared checkout).
        "graphamp_dirty": _git_dirty(),
        "versions": {p: version(p) for p in ("torch", "transformers", "timm", "diffusers", "torchvision")},
        "python": platform.python_version(),
        "cpu": hardware.cpu_model(),
        "cpu_flags": sorted(flags),
        "native": {"bf16": cap.native(torch.bfloat16), "fp16": cap.native(torch.float16)},
        "threads": torch.get_num_threads(),
    }


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


def merge_results(out: Path, newer: Path) -> int:
    """Update ``out`` with a re-run's rows (``newer``): each check the re-run made replaces that check
    of the model's row, which records the re-run (date, commit, checks) under ``rerun``. Returns how
    many rows changed. Rows of models the re-run could not build or run stay as they were."""
    head, records = read_results(out)
    new_head, new_records = read_results(newer)
    stamp = {"date": (new_head or {}).get("date"), "commit": (new_head or {}).get("graphamp_commit")}
    changed = 0
    for model, row in new_records.items():
        old = records.get(model)
        if row.get("eager", {}).get("status") != "ok" or row.get("status") != "done":
            continue
        if old is None:
            records[model] = row
            changed += 1
            continue
        merged = dict(old)
        # The re-run's build (a changed shrink builds another size) is the one its checks ran on.
        merged.update({k: row[k] for k in ("class", "note", "params") if k in row})
        merged["checks"] = {**old.get("checks", {}), **row.get("checks", {})}
        merged["requested"] = sorted(set(old.get("requested", CHECKS)) | set(row.get("requested", [])), key=CHECKS.index)
        if set(merged["requested"]) <= set(merged["checks"]):  # every check has a result now
            merged["status"] = "done"
            merged.pop("timeout_in", None)
            merged.pop("crash_in", None)
        merged["rerun"] = [*old.get("rerun", []), {**stamp, "checks": sorted(row.get("checks", {}))}]
        records[model] = merged
        changed += 1
    lines = [json.dumps(head)] if head else []
    lines += [json.dumps(r) for r in records.values()]
    out.write_text("\n".join(lines) + "\n")
    return changed


def _worker_command(name: str, checks: tuple[str, ...], result: Path, threads: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--checks", ",".join(checks), "--result", str(result), "--threads", str(threads)]


def run_one(name: str, checks: tuple[str, ...], timeout: float, threads: int) -> dict[str, Any]:
    """``name`` in a subprocess with a time limit; a killed or crashed worker keeps its finished checks."""
    with tempfile.TemporaryDirectory(prefix="census-") as tmp:
        result = Path(tmp) / "result.json"
        log = Path(tmp) / "log.txt"
        with open(log, "wb") as out:
            proc = subprocess.Popen(_worker_command(name, checks, result, threads), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
        data = json.loads(result.read_text()) if result.exists() else {"model": name, "family": name.split("/")[0], "checks": {}}
        if code is None:
            data["status"] = "timeout"
            data["timeout_in"] = data.pop("current", None)
            data["seconds"] = timeout
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


def run_census(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _, done = read_results(out) if args.resume else (None, {})
    if args.retry_unfinished:
        done = {n: r for n, r in done.items() if r.get("status") == "done"}
    if not args.resume and out.exists():
        sys.exit(f"{out} exists: pass --resume to continue it, or --out another file")
    names = [n for n in select(census_models.population(), args.only, args.shard, args.sample, args.seed) if n not in done]
    checks = tuple(args.checks.split(","))
    if not out.exists() or out.stat().st_size == 0:
        with open(out, "a") as f:
            f.write(json.dumps(header()) + "\n")
    print(f"census: {len(names)} models to run ({len(done)} already in {out}), checks {','.join(checks)}, {args.jobs} job(s), {args.timeout:.0f} s each", flush=True)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_one, n, checks, args.timeout, threads): n for n in names}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            data = fut.result()
            with open(out, "a") as f:
                f.write(json.dumps(data) + "\n")
            print(f"[{i}/{len(names)}] {data['model']}: {_one_line(data)}", flush=True)
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
        return f"{data.get('status', 'unfinished')} in {data.get('timeout_in') or data.get('crash_in') or '?'}"
    if result["status"] == "error":
        return f"{result['type']}: {normalize(result['message'])}"
    if result["status"] == "differ":
        what = "dtype" if result.get("dtype_mismatch") else ("grad" if str(result.get("first", "")).startswith("grad") else "value")
        return f"differ ({what}){' after a graphamp warning' if result.get('reported') else ''}"
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
    return {"models": len(records), "eager_runs": len(runs), "eager_cannot": len(cannot), "table": table, "causes": causes,
            "cannot": Counter(normalize(r.get("eager", {}).get("message") or r.get("status", "?"))[:90] for r in cannot.values())}


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
    if markdown:
        print(markdown_table(s), file=file)
    else:
        print(f"{'check':14s} " + " ".join(f"{k:>15s}" for k in KINDS), file=file)
        for check, counts in s["table"].items():
            print(f"{check:14s} " + " ".join(f"{counts.get(k, 0):>15d}" for k in KINDS), file=file)
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


def markdown_table(s: dict[str, Any]) -> str:
    lines = [f"| of {s['eager_runs']} models eager runs | bitwise | differ, silent | differ, reported | error, silent | error, reported | skipped | timeout/crash |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for check, counts in s["table"].items():
        lines.append(f"| {check} | " + " | ".join(str(counts.get(k, 0)) for k in KINDS) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON-lines results file (default %(default)s)")
    p.add_argument("--resume", action="store_true", help="skip models already in --out and append")
    p.add_argument("--retry-unfinished", action="store_true", help="with --resume, run again the models that timed out or crashed")
    p.add_argument("--only", help="regex over model names (hf/bert, timm/resnet18, diffusers/dit)")
    p.add_argument("--shard", help="i/n: every n-th model from the i-th")
    p.add_argument("--sample", type=float, help="keep this fraction of the transformers models (seeded), all timm/diffusers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checks", default=",".join(CHECKS), help="comma-separated, from " + ",".join(CHECKS))
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: cores / jobs)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per model (default %(default)s)")
    p.add_argument("--summary", metavar="FILE", help="only print the summary of a results file")
    p.add_argument("--merge", metavar="FILE", help="update --out with a re-run's results file (per check), then exit")
    p.add_argument("--markdown", action="store_true", help="the summary table as markdown")
    p.add_argument("--list", action="store_true", help="print the selected model names and exit")
    p.add_argument("--ci-sample", action="store_true", help="the CI sample (census_sample.py), each model with its own checks")
    p.add_argument("--in-process", action="store_true", help="run the models in this process, one after another (CI sample)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
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
        run_in_process({n: _plan(args)[n] for n in names}, Path(args.out), args.timeout)
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
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    run_model(args.worker, tuple(args.checks.split(",")), Path(args.result))


if __name__ == "__main__":
    main()
