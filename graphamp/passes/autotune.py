"""Raise to fp32 each low-precision op that measures faster in fp32 here (``mode="autotune"``).

Low precision is only faster where the hardware computes it natively. This pass starts from
autocast's program (insert_casts, dedupe_casts and fold_casts have run) and, for every op autocast
runs in the low dtype, times on this machine and at the example's shapes the op plus the casts its
choice implies, in the low dtype against fp32:

* low: the casts of its fp32 inputs down (a weight frozen at conversion is free), then the op;
* fp32: the casts of its low inputs up (those of an op already raised are not needed), then the op,
  then the cast of its output down where it flows into another low-precision op.

Where the conversion keeps a gradient path (not ``inference=True``), each timing runs the op's
backward too: the gradients of its floating inputs, through the casts (whose backward is a cast
back), from a gradient of ones at its output. A training step pays both, and on a CPU that
emulates the low dtype the backward's two matmuls can move the balance either way.

Both also run the ops after it whose dtype its choice decides (a single-consumer chain of batch
norm, activations, views... up to the next such op), since raising an op moves them to fp32 too.

A fused kernel eager runs whole under autocast (an eval ``nn.TransformerEncoderLayer`` under
``inference=True``, see fuse_encoder_layers.py) is a candidate too: raised, it runs with autocast
off, as eager fp32 runs it.

It raises an op to fp32 only when fp32 is faster by ``margin``: a tie, or a difference within the
noise of a shared machine, keeps autocast's choice. It decides in graph order, so each op sees what the ops before it became. It only ever
raises precision: ops autocast runs in fp32 stay fp32. The raised ops are then rewritten as if
autocast listed them fp32 (insert_casts' own rules), and the cast passes tidy up.

Each op signature (op, shapes, strides, dtypes, other arguments, machine) is timed once: results are
kept in a :class:`graphamp.autotune.measure.MeasurementCache` (this process, and a JSON file under ``$GRAPHAMP_CACHE_DIR`` or
``~/.cache/graphamp``). Measuring stops once ``budget_s`` is spent; ops left unmeasured keep
autocast's dtype and the plan counts them. ``Config(plan=...)`` replays a plan without measuring.
Timing is device-agnostic: on CUDA the default timer synchronizes the device around each call.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphamp import hardware
from graphamp.eager import rng_kept
from graphamp.passes.dedupe_casts import dedupe_casts
from graphamp.passes.fold_casts import fold_casts
from graphamp.passes.graph_edit import attr_of, cast_source, is_graphamp_cast, tensor_dtype
from graphamp.passes.insert_casts import _cast_slots, _Rewriter
from graphamp.node_info import graph_info, info, peek
from graphamp.autotune.measure import SETTINGS, Timer, Trial, default_cache
from graphamp.autotune.plan import AutotunePlan, fingerprint
from graphamp.policy import Category, op_key, short_dtype
from graphamp.runtime import autocast_cached, autocast_op

if TYPE_CHECKING:
    from graphamp.spec import AmpSpec

__all__ = ["autotune"]

_log = logging.getLogger("graphamp")


def _hint(d: int | torch.SymInt) -> int:
    if isinstance(d, torch.SymInt):
        hint = d.node.hint
        if hint is None:
            raise ValueError(f"size {d} has no example value")
        return int(hint)
    return int(d)


def _dim(d: int | torch.SymInt) -> str:
    if isinstance(d, torch.SymInt):
        expr = d.node.expr
        return str(int(expr)) if expr.is_number else "?"
    return str(d)


def _sizes(val: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape = tuple(_hint(d) for d in val.shape)
    try:
        stride = tuple(_hint(s) for s in val.stride())
    except (ValueError, RuntimeError):
        stride = tuple(torch.empty(shape, device="meta").stride())
    return shape, stride


def _example(val: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A real tensor with ``val``'s sizes, strides and device (and ``dtype``), of random values."""
    shape, stride = _sizes(val)
    dtype = dtype or val.dtype
    numel = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
    if dtype.is_floating_point:
        base = torch.randn(numel, device=val.device).to(dtype)
    elif dtype is torch.bool:
        base = torch.ones(numel, dtype=dtype, device=val.device)
    else:
        base = torch.zeros(numel, dtype=dtype, device=val.device)
    return base.as_strided(shape, stride)


def _fp32_source(node: Node) -> Node | None:
    """The fp32 value ``node`` casts down, if ``node`` is one of graphamp's casts of one."""
    if not isinstance(node, Node):
        return None
    if node.target is autocast_cached:  # dedupe_casts' shared cast of an input (no cast record of its own)
        src = node.args[0]
    elif not is_graphamp_cast(node):
        return None
    else:
        found = cast_source(node)
        if found is None:
            return None
        src = found[0]
    return src if tensor_dtype(src) is torch.float32 else None


def _is_tensor(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _raised_origin(node: Node, raised: set[Node]) -> bool:
    """Whether ``node`` (through views and casts) is the output of an op this pass raised."""
    seen = 0
    while isinstance(node, Node) and seen < 8:
        if node in raised:
            return True
        if node.op != "call_function" or len(node.all_input_nodes) != 1:
            return False
        node = node.all_input_nodes[0]
        seen += 1
    return False


class _Candidate:
    """One op autocast runs in the low dtype, with what timing it needs."""

    def __init__(self, gm: GraphModule, node: Node, spec: AmpSpec) -> None:
        self.node = node
        # A fused kernel eager runs whole under autocast (fuse_encoder_layers): its fp32 variant is
        # the same kernel with autocast off, as eager fp32 runs it.
        self.fused = node.target is autocast_op
        self.op = op_key(node.args[0]) if self.fused else op_key(node.target)
        self.low: torch.dtype = node.args[2] if self.fused else peek(node).dtype
        # Sizes export kept symbolic print as "?": their symbols' names are not stable across captures.
        shapes = [tuple(_dim(d) for d in v.meta["val"].shape) for v in node.all_input_nodes if isinstance(v.meta.get("val"), torch.Tensor)]
        self.signature = (node.name, self.op, ";".join("x".join(s) for s in shapes))
        self.gm, self.spec = gm, spec
        self.feeds_low = False  # set by _candidates: raised, its output needs a cast down for the next op
        # The ops after it whose precision its choice decides (batch norm, activations, views), up
        # to the next candidate: timed with it, in the dtype it leaves them.
        self.chain: list[Node] = []

    def follow(self, others: set[Node]) -> list[Node]:
        """The single-consumer chain after this op whose other inputs are weights or sizes."""
        chain: list[Node] = []
        current = self.node
        while len(chain) < 8 and len(current.users) == 1:
            (user,) = current.users
            if user in others or user.op != "call_function":
                break
            if not (isinstance(user.target, torch._ops.OpOverload) or user.target is operator.getitem):
                break
            if any(a is not current and a.op != "get_attr" and _is_tensor(a) for a in user.all_input_nodes):
                break
            if current not in user.args or any(v is current for v in user.kwargs.values()):
                break  # timed with the previous output as a positional argument only
            chain.append(user)
            current = user
        return chain

    def reaches(self, others: set[Node]) -> bool:
        """Whether the output flows, through ops of one tensor input (views, casts, activations),
        into one of ``others``."""
        frontier, depth = [self.chain[-1] if self.chain else self.node], 0
        while frontier and depth < 8:
            nxt = []
            for n in frontier:
                for user in n.users:
                    if user in others:
                        return True
                    if user.op == "call_function" and len([a for a in user.all_input_nodes if _is_tensor(a)]) == 1:
                        nxt.append(user)
            frontier, depth = nxt, depth + 1
        return False

    def _free_weight(self, src: Node) -> bool:
        # inference=True freezes a parameter used only in low precision: its cast happens once, now.
        return self.spec.inference and src.op == "get_attr" and isinstance(attr_of(self.gm, src.target), nn.Parameter)

    def classify(self, raised: set[Node], paid: set[Node]) -> tuple[str, dict[Node, str]]:
        """The cache key of this op and, per tensor input, what each choice costs for it.

        Kinds: "fp32-cast" (an fp32 value cast down: low pays the cast), "frozen" or "paid" (a
        cast made anyway: a weight frozen at conversion, or one an op kept low already shares),
        "raised-cast" (low, but its producer was raised: low pays a cast down), "low" (fp32 pays
        a cast up), "other" (not the low dtype: as it is for both).
        """
        kinds: dict[Node, str] = {}
        key: list[str] = []
        for arg in self.node.all_input_nodes:
            val = arg.meta.get("val")
            if not isinstance(val, torch.Tensor):
                kinds[arg] = "other"
                key.append(repr(val))
                continue
            src = _fp32_source(arg)
            if val.dtype is self.low and src is not None:
                kind = "frozen" if self._free_weight(src) else "paid" if arg in paid else "fp32-cast"
            elif val.dtype is self.low:
                kind = "raised-cast" if _raised_origin(arg, raised) else "low"
            else:
                kind = "other"
            kinds[arg] = kind
            shape, stride = _sizes(val)
            key.append(f"{short_dtype(val.dtype)}{list(shape)}{list(stride)}:{kind}")
        constants = torch.fx.node.map_arg((self.node.args, self.node.kwargs), lambda a: None)
        out = "|out-cast" if self.feeds_low else ""
        if self.chain:
            out += "|then " + ",".join(op_key(n.target) if isinstance(n.target, torch._ops.OpOverload) else "getitem" for n in self.chain)
        return f"{self.op}|{short_dtype(self.low)}|{'|'.join(key)}|{constants!r}{out}", kinds

    def runs(self, kinds: dict[Node, str], *, backward: bool = False) -> tuple[Callable[[], Any], Callable[[], Any], Trial, Trial]:
        """The low and fp32 callables of this op on random inputs of its example's sizes, with their
        trials; with ``backward``, each call also computes the gradients of the floating inputs."""
        node, low = self.node, self.low
        cast = torch.ops.aten._to_copy.default
        made: dict[Node, tuple[Callable[[], Any], Callable[[], Any]]] = {}
        leaves: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # per variant: what backward differentiates

        def leaf(x: Any, *variants: int) -> Any:
            if backward and isinstance(x, torch.Tensor) and x.is_floating_point():
                x = x.detach().requires_grad_(True)
                for v in variants:
                    leaves[v].append(x)
            return x

        for arg, kind in kinds.items():
            val = arg.meta.get("val")
            if kind == "other":
                x = leaf(_example(val), 0, 1) if isinstance(val, torch.Tensor) else val
                made[arg] = (lambda x=x: x, lambda x=x: x)
            elif kind in ("fp32-cast", "raised-cast"):
                x32 = leaf(_example(val, torch.float32), 0, 1)
                made[arg] = (lambda x=x32: cast(x, dtype=low), lambda x=x32: x)
            elif kind in ("frozen", "paid"):
                x32 = _example(val, torch.float32)
                x = leaf(x32.to(low), 0)
                x32 = leaf(x32, 1)
                made[arg] = (lambda x=x: x, lambda x=x32: x)
            else:
                x = leaf(_example(val), 0, 1)
                made[arg] = (lambda x=x: x, lambda x=x: cast(x, dtype=torch.float32))

        def bind(variant: int) -> Callable[[], Any]:
            # Inputs become zero-argument callables (a cast, or the tensor itself), resolved per call.
            thunk = type("_Thunk", (), {})
            args = torch.fx.node.map_arg(node.args, lambda a: (thunk, made[a][variant]))
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: (thunk, made[a][variant]))
            target = node.target
            if self.fused and variant == 1:
                target, args = args[0], args[3:]

            def resolve(x: Any) -> Any:
                if isinstance(x, tuple) and len(x) == 2 and x[0] is thunk:
                    return x[1]()
                if isinstance(x, (list, tuple)):
                    return type(x)(resolve(y) for y in x)
                return x

            def run() -> Any:
                return target(*resolve(args), **{k: resolve(v) for k, v in kwargs.items()})

            return run

        tensors = [v.meta["val"] for v in node.all_input_nodes if isinstance(v.meta.get("val"), torch.Tensor)]
        shapes = tuple(_sizes(v)[0] for v in tensors)
        device = tensors[0].device if tensors else torch.device("cpu")
        run_low, run_fp32 = self._then_chain(bind(0)), self._then_chain(bind(1))
        if self.feeds_low:
            plain_fp32 = run_fp32

            def run_fp32() -> Any:
                out = plain_fp32()
                return cast(out, dtype=low) if isinstance(out, torch.Tensor) else out

        if backward:
            run_low, run_fp32 = _with_backward(run_low, leaves[0]), _with_backward(run_fp32, leaves[1])
        return (
            run_low, run_fp32,
            Trial(self.op, low, shapes, device, backward), Trial(self.op, torch.float32, shapes, device, backward),
        )

    def _then_chain(self, run: Callable[[], Any]) -> Callable[[], Any]:
        if not self.chain:
            return run
        steps = []
        previous = self.node
        for node in self.chain:
            def value(a: Node, previous: Node = previous) -> Any:
                if a is previous:
                    return _PREVIOUS
                if a.op == "get_attr":
                    return attr_of(self.gm, a.target)
                val = a.meta.get("val")
                return _hint(val) if isinstance(val, (int, torch.SymInt)) else val

            args = torch.fx.node.map_arg(node.args, value)
            kwargs = torch.fx.node.map_arg(node.kwargs, value)
            steps.append((node.target, args, kwargs))
            previous = node

        def chained() -> Any:
            out = run()
            for target, args, kwargs in steps:
                out = target(*[out if a is _PREVIOUS else a for a in args], **kwargs)
            return out

        return chained


_PREVIOUS = object()  # where a chained op takes the previous op's output


def _with_backward(run: Callable[[], Any], leaves: list[torch.Tensor]) -> Callable[[], Any]:
    """``run`` followed by its backward: the gradients of ``leaves`` from ones at every floating
    output that needs one (nothing more when no output does)."""

    def forward_backward() -> Any:
        with torch.enable_grad():
            out = run()
            outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs and leaves:
                torch.autograd.grad(outs, leaves, [torch.ones_like(t) for t in outs], allow_unused=True)
        return out

    return forward_backward


def _candidates(gm: GraphModule, spec: AmpSpec) -> list[_Candidate]:
    found = []
    for node in gm.graph.nodes:
        record = peek(node)
        if (
            node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload)
            and record is not None
            and record.category == Category.LOWER_PRECISION_FP.value
            and record.dtype in (torch.bfloat16, torch.float16)
        ):
            found.append(_Candidate(gm, node, spec))
        elif node.op == "call_function" and node.target is autocast_op and node.args[1] == spec.device_type:
            found.append(_Candidate(gm, node, spec))
    nodes = {c.node for c in found}
    for c in found:
        if not c.fused:
            c.chain = c.follow(nodes)
        c.feeds_low = c.reaches(nodes - {c.node})
    return found


class _RaiseRewriter(_Rewriter):
    """insert_casts' rules, with the raised ops listed fp32."""

    def __init__(self, gm: GraphModule, spec: AmpSpec, raised: dict[Node, str]) -> None:
        super().__init__(gm, spec.policy, spec.config, kernel_paths=spec.target == "module")
        self.raised = raised

    def category_of(self, node: Node) -> tuple[Category | None, torch.dtype, str]:
        why = self.raised.get(node)
        if why is not None:
            return Category.FP32, self.policy.dtype, why
        return super().category_of(node)

    def apply_policy(self, node: Node) -> bool:
        # A raised op's inputs were swapped for their fp32 sources: its value must be re-derived.
        return super().apply_policy(node) or node in self.raised


def _raise(gm: GraphModule, spec: AmpSpec, raised: dict[Node, str]) -> None:
    """Rewrite the graph so the ``raised`` ops compute in fp32 (their fp32 inputs uncast)."""
    for node in raised:
        if node.target is autocast_op:  # the fused kernel without autocast: eager's fp32 program
            node.target, node.args = node.args[0], node.args[3:]
        for where, index, src in _cast_slots(node):
            origin = _fp32_source(src)
            if origin is not None:
                node.replace_input_with(src, origin)
    for node in reversed(list(gm.graph.nodes)):
        if (is_graphamp_cast(node) or node.target is autocast_cached) and not node.users:
            gm.graph.erase_node(node)
    _RaiseRewriter(gm, spec, raised).run()
    gm.graph.lint()
    gm.recompile()
    dedupe_casts(gm, spec)
    fold_casts(gm, spec)


def autotune(gm: GraphModule, spec: AmpSpec) -> PassResult:
    """Raise to fp32 the low-precision ops that measure faster in fp32 (or that ``Config.plan`` raised)."""
    candidates = _candidates(gm, spec)
    ops = {c.node.name: f"{c.op} {c.signature[2]}" for c in candidates}
    model = fingerprint([c.signature for c in candidates])
    plan = spec.config.plan
    if plan is not None:
        plan.check(spec.device_type, spec.dtype, model, ops)
        raised = {c.node: f"fp32 (autotune plan: {_plan_reason(plan, c.node.name)})" for c in candidates if plan.decisions[c.node.name] is torch.float32}
        for c in candidates:
            dtype = plan.decisions[c.node.name]
            info(c.node).notes["autotune"] = {"chosen": short_dtype(dtype), "source": "plan", **_times_note(plan.times_ms.get(c.node.name))}
        new_plan = plan
    else:
        new_plan, raised = _measure(gm, spec, candidates, model, ops)
    graph_info(gm).plan = new_plan
    if raised:
        reasons = {n: info(n).reason for n in raised}
        notes = {n: dict(info(n).notes) for n in raised}
        _raise(gm, spec, raised)
        for n in raised:  # keep the autotune record through the rewrite's fresh policy pass
            info(n).reason = raised[n]
            info(n).notes.update(notes[n])
            info(n).notes["autotune"]["autocast"] = reasons[n]
    return PassResult(gm, bool(raised))


def _plan_reason(plan: AutotunePlan, name: str) -> str:
    times = plan.times_ms.get(name)
    return f"measured {times[1]:.3g} ms fp32 vs {times[0]:.3g} ms {short_dtype(plan.dtype)}" if times else "replayed"


def _times_note(times: tuple[float, float] | None) -> dict[str, float]:
    return {"low_ms": times[0], "fp32_ms": times[1]} if times else {}


# Low and fp32 kernels of one op rarely differ by more than this; a larger ratio suggests a burst of
# other work hit one timing: measure again.
_SUSPECT_RATIO = 4.0
_MAX_ROUNDS = 4


def _time_pair(timer: Timer, run_low: Callable[[], Any], trial_low: Trial, run_fp32: Callable[[], Any], trial_fp32: Trial) -> tuple[float, float, bool]:
    """(low s, fp32 s, settled): each the fastest of rounds timed alternately (low, fp32, ...).

    Two rounds at least; up to four while the two fastest rounds of a dtype differ by more than 2x:
    on a shared machine a burst of load can slow every call of one timing, and the fastest round is
    the least disturbed. Dtypes more than ``_SUSPECT_RATIO`` apart take a third round, which must
    agree too (a CPU that emulates the low dtype makes 50x real). ``settled`` says the last test
    passed; a pair that never settled decides this conversion but is not kept in the cache, where it
    would decide every later one.
    """
    lows, fp32s = [], []
    settled = False
    while len(lows) < _MAX_ROUNDS:
        lows.append(float(timer(run_low, trial_low)))
        fp32s.append(float(timer(run_fp32, trial_fp32)))
        if len(lows) < 2:
            continue
        (low, low2), (fp32, fp32_2) = sorted(lows)[:2], sorted(fp32s)[:2]
        if min(low, fp32) <= 0:
            break
        # The two fastest rounds of each dtype agree, and the dtypes differ plausibly: done.
        if max(low2 / low, fp32_2 / fp32) <= 2.0 and (max(low / fp32, fp32 / low) <= _SUSPECT_RATIO or len(lows) >= 3):
            settled = True
            break
    return min(lows), min(fp32s), settled


def _measure(gm: GraphModule, spec: AmpSpec, candidates: list[_Candidate], model: str, ops: dict[str, str]) -> tuple[AutotunePlan, dict[Node, str]]:
    settings = SETTINGS.get()
    cache = settings.cache if settings.cache is not None else default_cache()
    machine = hardware.capability(spec.device_type).key()
    start = time.perf_counter()
    raised: dict[Node, str] = {}
    decisions: dict[str, torch.dtype] = {}
    times_ms: dict[str, tuple[float, float]] = {}
    measured = cached = unmeasured = 0
    timed_now: set[str] = set()
    unsettled: dict[str, tuple[float, float]] = {}  # timings too disturbed to keep in the cache
    paid: set[Node] = set()  # casts down an op kept low makes, which later ops share for free
    # A training conversion is timed forward and backward: a step pays both.
    backward = not spec.inference and not spec.no_grad
    # Timed chains may hold dropout: the random state is the caller's again after measuring.
    with torch.no_grad(), rng_kept():
        for c in candidates:
            name, low = c.node.name, c.low
            key, kinds = c.classify(set(raised), paid)
            key = f"{machine}|{key}" + ("|fwd+bwd" if backward else "")
            times = unsettled.get(key) or cache.get(key)
            source = "cache"
            if times is None or key in timed_now:
                if times is None and time.perf_counter() - start >= settings.budget_s:
                    decisions[name] = low
                    unmeasured += 1
                    info(c.node).notes["autotune"] = {"chosen": short_dtype(low), "source": f"not measured: the budget of {settings.budget_s:g} s was spent"}
                    paid.update(n for n, kind in kinds.items() if kind == "fp32-cast")
                    continue
                if times is None:
                    try:
                        run_low, run_fp32, trial_low, trial_fp32 = c.runs(kinds, backward=backward)
                        *times, settled = _time_pair(settings.timer, run_low, trial_low, run_fp32, trial_fp32)
                    except Exception as e:  # an op graphamp cannot time alone keeps autocast's dtype
                        decisions[name] = low
                        unmeasured += 1
                        info(c.node).notes["autotune"] = {"chosen": short_dtype(low), "source": f"not measured: {type(e).__name__}: {e}"[:200]}
                        paid.update(n for n, kind in kinds.items() if kind == "fp32-cast")
                        continue
                    times = tuple(times)
                    if settled:
                        cache.put(key, times)
                    else:
                        unsettled[key] = times
                    timed_now.add(key)
                    measured += 1
                source = "measured"
            else:
                cached += 1
            t_low, t_fp32 = times
            keep_low = not t_fp32 < (1 - settings.margin) * t_low
            decisions[name] = low if keep_low else torch.float32
            times_ms[name] = (t_low * 1e3, t_fp32 * 1e3)
            info(c.node).notes["autotune"] = {"chosen": short_dtype(decisions[name]), "source": source, **_times_note(times_ms[name])}
            if keep_low:
                paid.update(n for n, kind in kinds.items() if kind == "fp32-cast")
            else:
                raised[c.node] = (
                    f"fp32 (autotune: {t_fp32 * 1e3:.3g} ms in fp32 vs {t_low * 1e3:.3g} ms in {short_dtype(low)}, "
                    f"casts included, {source})"
                )
    spent = time.perf_counter() - start
    if measured:
        cache.save()
    plan = AutotunePlan(
        spec.device_type, spec.dtype, model, decisions, times_ms, ops, machine=machine, measure_s=spent,
        measured=measured, cached=cached, unmeasured=unmeasured,
    )
    _log.info("graphamp %s", plan.summary())
    return plan, raised
