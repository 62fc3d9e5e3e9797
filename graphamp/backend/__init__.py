"""``torch.compile(model, backend="graphamp")``: graphamp's rewrite inside the PyTorch 2 compiler stack.

For each graph dynamo captures (one per graph break), the backend:

1. fakifies the inputs with dynamo's own fake mode;
2. re-traces dynamo's torch-level graph to pre-dispatch ATen with ``make_fx``, under the autocast
   graphamp applies, so every node's fake value carries eager autocast's dtype. On the way it
   replaces fused inference kernels by their composites (:mod:`graphamp.backend.fast_paths`) and keeps each
   custom ``autograd.Function`` (dynamo's ``autograd_function_apply``: a forward and a backward
   graph) whole, as one call of :func:`graphamp.runtime.apply_graph_function`, so that AOTAutograd
   records its forward under eager's autocast state and its own backward;
3. runs graphamp's passes (:mod:`graphamp.passes`), as :func:`graphamp.convert` does, after
   observing what eager does where dynamo's graph holds another program (attention over repeated
   key/value heads: :mod:`graphamp.backend.observe` runs the compiled frame once eagerly), and
   shares each parameter's cast between its uses, as autocast's cache does
   (:mod:`graphamp.backend.weight_casts`). Outside ``torch.autocast``, dynamo traced the model's
   Python in fp32: it gets the dtypes eager autocast's Python passes and the ``autocast(enabled=False)``
   regions it enters (:mod:`graphamp.backend.eager_regions`); where it cannot, the backend warns, and a
   fill value that overflows the low dtype is an error (:mod:`graphamp.backend.fill_values`);
4. hands the rewritten graph to AOTAutograd and the inner compiler (inductor, or eager graphs)
   with autocast off, and runs the compiled code with autocast off: graphamp's casts are the only
   ones applied, whether or not the call sits inside a ``torch.autocast`` region. A graph without
   grad under ``inner="eager"`` skips AOTAutograd and runs as rewritten: AOTAutograd's
   decompositions (``upsample_bilinear2d``'s index arithmetic) round otherwise than eager's kernels.

The backend is registered under the ``torch_dynamo_backends`` entry point, so ``backend="graphamp"``
works after ``pip install`` without importing graphamp.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from graphamp.capture.stacks import source_lines_read_lazily
from graphamp.config import Config
from graphamp.errors import OptionError, PolicyDriftError
from graphamp.passes import build_pipeline, check_dtypes, run_passes
from graphamp.policy import DEVICE_TYPES, resolve_dtype
from graphamp.shared_state import capture_lock
from graphamp.spec import AmpSpec, autocast_off, check_device, infer_device_type
from graphamp.backend.options import BackendOptions
from graphamp.backend.eager_dtypes import follow_eager_dtypes, graph_break_site
from graphamp.backend.fast_paths import follow_fused_attention
from graphamp.backend.eager_regions import follow_eager_regions
from graphamp.backend.eager_check import check_outputs, matches_eager
from graphamp.backend.observe import EagerRun, Frame, compiled_frame, eager_run, observe_eager_frame
from graphamp.backend.dropped_masks import Split, dispatch, eager_sdpa_calls_for, split_dropped_adds, split_dropped_masks
from graphamp.probe import SdpaCall
from graphamp.backend.retrace import _retrace
from graphamp.backend.fill_values import check_fill_values
from graphamp.backend.handover import check_handover
from graphamp.backend.break_calls import check_break_calls
from graphamp.backend.skipped_code import after_compiled_call, check_skipped_code, rest_checker
from graphamp.backend.options import INNER_COMPILERS
from graphamp.backend.weight_casts import share_parameter_casts
from graphamp.backend.inductor import inductor_patches


__all__ = ["BackendOptions", "INNER_COMPILERS", "graphamp_backend", "rewrite"]


@source_lines_read_lazily()
def graphamp_backend(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The dynamo backend: rewrite ``gm`` into explicit mixed precision, then compile it.

    ``options`` are graphamp's (see :class:`BackendOptions`); ``mode`` is torch.compile's own
    ("max-autotune", ...) and is passed on to inductor.

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
    >>> x = torch.randn(4, 8)
    >>> compiled = torch.compile(model, backend="graphamp", options={"inner": "eager"})
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     expected = model(x)
    >>> assert torch.equal(compiled(x), expected)
    """
    opts = BackendOptions.parse(options)
    # Dynamo holds the capture lock while it calls a backend; taken again for direct calls.
    with capture_lock():
        return _compile(gm, example_inputs, opts, inductor_mode=mode)


def _compile(gm: GraphModule, example_inputs: Sequence[Any], opts: BackendOptions, *, inductor_mode: str | None) -> Callable[..., Any]:
    if inductor_mode is not None and opts.inner != "inductor":
        raise OptionError(
            f"torch.compile(mode={inductor_mode!r}) configures inductor, but graphamp's inner compiler is "
            f"{opts.inner!r}; drop mode= or use options={{'inner': 'inductor'}}"
        )
    if not any(n.op in ("call_function", "call_method", "call_module") for n in gm.graph.nodes):
        # No op to cast or compile: dynamo hands over empty graphs (``return ()``) around graph breaks.
        return gm.forward
    device_type = opts.device_type or _device_type_of(gm, example_inputs)
    check_device(device_type, gm, list(example_inputs))
    # Dynamo restores the caller's global state while a backend runs and guards on it, so the
    # grad mode now is the one every call of this graph will see.
    inference = not torch.is_grad_enabled() and not _enables_grad(gm)
    spec = AmpSpec(device_type, resolve_dtype(opts.dtype, device_type), opts.mode, inference, opts.config or Config(), target="aot")
    ambient = torch.is_autocast_enabled(device_type)
    if device_type == "cpu":
        # eager CPU autocast runs nn.MultiheadAttention's fused kernel where tracing turned it off
        follow_fused_attention(gm)
    frame = compiled_frame()
    check_rest = None
    exact = spec.mode == "exact"
    eager = (
        eager_run(frame, device_type=device_type, dtype=spec.dtype, cache_enabled=spec.config.cache_enabled, grad=not inference)
        if frame is not None and exact and (opts.self_check or not ambient) else None
    )
    if not ambient and exact:
        # Outside torch.autocast dynamo traced the model's Python in fp32: give the graph the dtypes
        # eager autocast's Python passes, and say so where it cannot.
        follow_eager_dtypes(gm, frame, device_type=device_type, dtype=spec.dtype, low=eager)
        if eager is not None:
            follow_eager_regions(gm, eager.autocast_off_sites, device_type=device_type)
        if opts.self_check and graph_break_site(gm) is not None:
            # The instruction dynamo runs eagerly at the break, without autocast.
            check_break_calls(gm, frame, device_type=device_type, dtype=spec.dtype, cache_enabled=spec.config.cache_enabled)
            # The rest of the frame after the break, where dynamo skips it during the first call.
            check_rest = rest_checker(frame, device_type=device_type, dtype=spec.dtype, cache_enabled=spec.config.cache_enabled)
        if opts.self_check:
            # Code dynamo skipped, above this frame, runs eagerly in fp32 (graphamp.backend.skipped_code).
            check_skipped_code(frame, device_type=device_type, dtype=spec.dtype, cache_enabled=spec.config.cache_enabled)
    # Where eager's Python dropped an input-dependent attention mask by value, eager's program and
    # dynamo's are both compiled, and each call picks by the mask (graphamp.backend.dropped_masks).
    sdpa_calls = eager_sdpa_calls_for(gm, frame, device_type=device_type, dtype=spec.dtype) if exact else None
    split = split_dropped_masks(gm, sdpa_calls, example_inputs)
    with autocast_off():
        amp_gm = rewrite(gm, example_inputs, spec, ambient=ambient, frame=frame, sdpa_calls=[] if split else sdpa_calls)
        if not ambient and eager is not None:
            # The code after a graph break runs without autocast on the values this graph hands over.
            check_handover(gm, amp_gm, frame, device_type=device_type, dtype=spec.dtype, cache_enabled=spec.config.cache_enabled)
        eager_gm = None
        if split is None and eager is not None:
            # Eager attention's ``scores + mask`` with a mask eager dropped: (graphamp.backend.dropped_masks).
            split, eager_gm = _follow_dropped_adds(gm, amp_gm, example_inputs, spec, ambient=ambient, frame=frame, eager=eager, sdpa_calls=sdpa_calls)
        compiled = _run_without_autocast(_hand_off(amp_gm, example_inputs, opts.inner, inductor_mode, inference=inference))
        if split is not None:
            amp_gm = eager_gm or rewrite(split.eager_program, example_inputs, spec, ambient=ambient, frame=frame, sdpa_calls=sdpa_calls)
            eager_program = _run_without_autocast(_hand_off(amp_gm, example_inputs, opts.inner, inductor_mode, inference=inference))
            compiled = dispatch(split, eager_program, compiled)
    if spec.check and opts.self_check:
        # inner="eager" claims bitwise: check what runs (AOTAutograd decomposes some ops in
        # training). Inductor's code rounds otherwise by design: check graphamp's graph (the
        # example's program, where there are two). A graph that ends at a graph break is said,
        # not checked; in training the gradients of one backward are compared too. A Config that
        # changes the policy (op overrides, fp32 modules) is not autocast's: not compared.
        check_outputs(
            compiled if opts.inner == "eager" else amp_gm, example_inputs, frame, eager, graph=amp_gm, traced=gm,
            device_type=device_type, dtype=spec.dtype, cache_enabled=spec.config.cache_enabled, grads=not inference,
        )
    # After the self-check's calls: the model's first call is this graph's first.
    return compiled if check_rest is None else _checked_after_first_call(compiled, check_rest)


def rewrite(
    gm: GraphModule, example_inputs: Sequence[Any], spec: AmpSpec, *, ambient: bool = False, frame: Frame | None = None,
    sdpa_calls: list[SdpaCall] | None = None,
) -> GraphModule:
    """Re-trace dynamo's graph to pre-dispatch ATen and insert the policy's casts.

    ``spec.inference`` declares the graph runs under ``no_grad`` only, so casts are shared freely;
    ``ambient`` says dynamo traced inside an autocast region (it only changes warnings and errors);
    ``frame`` is the code dynamo compiled and its arguments, run eagerly where the graph may hold
    another program than eager's (see :mod:`graphamp.backend.observe`); ``sdpa_calls``, eager's
    attention calls when already observed (``[]``: follow none, the graph is dynamo's program).

    >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    >>> amp_gm = rewrite(gm, [torch.randn(2, 4)], AmpSpec("cpu", torch.bfloat16, target="aot"))
    >>> assert [n.kwargs["dtype"] for n in amp_gm.graph.nodes if n.target is torch.ops.aten._to_copy.default] == [torch.bfloat16] * 3
    """
    policy = spec.policy
    amp_gm = _retrace(gm, example_inputs, policy, ambient=ambient)
    observe_eager_frame(amp_gm, device_type=spec.device_type, dtype=spec.dtype, frame=frame, calls=sdpa_calls)
    run_passes(amp_gm, spec, build_pipeline(spec, check=False))
    share_parameter_casts(amp_gm, example_inputs)
    if not ambient:
        check_fill_values(amp_gm, device_type=spec.device_type, dtype=spec.dtype)
    if spec.check:
        try:
            check_dtypes(amp_gm, spec)
        except PolicyDriftError as e:
            if ambient:
                raise
            raise PolicyDriftError(
                f"{e}\nUnder torch.compile the likelier cause: dynamo traced forward's Python without "
                "autocast, so code that reads a tensor's dtype or the autocast state (nn.LSTM's initial "
                "state, torch.amp.custom_fwd, ...) decided as in fp32. Way out: call the compiled model "
                f"inside torch.autocast({policy.device_type!r}, dtype={policy.dtype}); graphamp's casts "
                "stay the only ones applied."
            ) from e
    return amp_gm


def _follow_dropped_adds(
    gm: GraphModule, amp_gm: GraphModule, example_inputs: Sequence[Any], spec: AmpSpec, *, ambient: bool,
    frame: Frame | None, eager: EagerRun, sdpa_calls: list[SdpaCall] | None,
) -> tuple[Split | None, GraphModule | None]:
    """The split between eager's program and dynamo's where dynamo's graph adds a mask that is zero on
    this call, its rewrite ``amp_gm`` differs from eager autocast here, and the rewrite of the graph
    without those adds matches it exactly (with that rewrite); else (None, None)."""
    try:
        split = split_dropped_adds(gm, example_inputs)
        if split is None or matches_eager(amp_gm, example_inputs, frame, eager, graph=amp_gm, traced=gm):
            return None, None
        candidate = rewrite(split.eager_program, example_inputs, spec, ambient=ambient, frame=frame, sdpa_calls=sdpa_calls)
    except Exception:  # no candidate, or one that cannot be rewritten: dynamo's program stays, and is checked
        return None, None
    if not matches_eager(candidate, example_inputs, frame, eager, graph=candidate, traced=gm):
        return None, None
    return split, candidate


def _device_type_of(gm: GraphModule, example_inputs: Sequence[Any]) -> str:
    device_type = infer_device_type(gm, list(example_inputs))
    if device_type not in DEVICE_TYPES:
        raise OptionError(
            f"the graph's tensors are on {device_type!r}, which has no graphamp policy; pass "
            f"options={{'device_type': ...}} with one of {DEVICE_TYPES}"
        )
    return device_type


def _enables_grad(gm: GraphModule) -> bool:
    """Whether the graph switches grad mode on somewhere (``torch.enable_grad()`` in forward)."""
    return any(
        n.op == "call_function" and n.target is torch._C._set_grad_enabled and n.args[0]
        for n in gm.graph.nodes
    )


def _hand_off(amp_gm: GraphModule, example_inputs: Sequence[Any], inner: str, inductor_mode: str | None, *, inference: bool = False) -> Callable[..., Any]:
    """Compile the rewritten graph with AOTAutograd and the inner compiler; inner="eager" without
    grad runs the graph itself (its ATen ops are eager's; AOTAutograd would decompose some)."""
    if inner == "eager" and inference:
        return amp_gm.forward
    if inner == "eager":
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=_eager_graph, bw_compiler=_eager_graph)(amp_gm, list(example_inputs))
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx


    return compile_fx(amp_gm, list(example_inputs), config_patches=inductor_patches(**(list_mode_options(inductor_mode) if inductor_mode else {})))


def _eager_graph(gm: GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """AOTAutograd's inner compiler for inner="eager": run the graph as is, with autocast off."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(_run_without_autocast(gm.forward))


def _run_without_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    # An ambient torch.autocast would re-apply its own policy to the graph's ops on top of
    # graphamp's casts. For a backward() called inside a region: inner="eager" wraps the backward
    # graph too (_eager_graph); inductor's code calls matmuls as out= variants, which autocast
    # never touches, and its fallback kernels (sdpa, convolution backward) are on no list.
    def run(*args: Any) -> Any:
        if torch._C._is_any_autocast_enabled():
            with autocast_off():
                return fn(*args)
        return fn(*args)

    return _called_as(run, fn)


def _checked_after_first_call(fn: Callable[..., Any], check: Callable[[], None]) -> Callable[..., Any]:
    """``fn``, running ``check`` as the compiled call of its first call returns, and again (a no-op
    where that ran) before its second call: where a profiler holds ``sys.setprofile``."""
    calls = itertools.count()

    def run(*args: Any) -> Any:
        n = next(calls)
        if n == 0:
            after_compiled_call(check)
        elif n == 1:
            check()
        return fn(*args)

    return _called_as(run, fn)


def _called_as(run: Callable[..., Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``run``, a wrapper of ``fn``, called by dynamo and AOTAutograd as ``fn`` is (boxed or not)."""
    run.__wrapped__ = fn  # type: ignore[attr-defined]
    for attr in ("_boxed_call",):
        if hasattr(fn, attr):
            setattr(run, attr, getattr(fn, attr))
    return run
