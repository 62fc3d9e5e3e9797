"""Insert explicit casts so that every ATen op sees the dtypes eager autocast would give it.

The walk visits nodes in order, so each node's inputs already carry their final dtypes (re-derived
on fake tensors after every edit, ``getitem`` outputs included). For each op it applies the rules of
``autocast_mode.h``:

* eligibility: a tensor is cast only if floating, not float64, and on the policy's device;
* lower_precision_fp / fp32: cast every eligible Tensor, Tensor? and Tensor[] argument whose dtype
  differs from the target;
* fp32_set_opt_dtype: if argument 0 is eligible and ``dtype`` is None, pass ``dtype=torch.float32``;
* fp32_append_dtype: redispatch ``norm`` to its dtype-taking overload;
* promote: float32 wins over the low dtype, float64 arguments are ignored;
* banned: raise, as eager does;
* in-place and ``out=`` overloads are never touched;
* a CompositeImplicitAutograd op that autocast does not list runs its decomposition with autocast
  still on, so when that decomposition holds listed ops the node is replaced by it.

Each op node's :class:`~graphamp.node_info.NodeInfo` gets its category, dtype and reason;
each cast records why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import warnings
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.infra.pass_base import PassResult
from torch.utils import _pytree as pytree

from graphamp.spec import ambient_autocast
from graphamp.config import Config
from graphamp.errors import BannedOpError, EagerPathWarning, PromoteTypeError
from graphamp.passes.grad_analysis import in_no_grad
from graphamp.passes.graph_edit import (
    carried_meta,
    dtypes_of,
    fake_mode_of,
    inline_subgraph,
    insert_cast,
    is_mutating,
    next_node,
    recompute_val,
    val_of,
)
from graphamp.node_info import AutocastFrame, info, innermost_module, region_of
from graphamp.policy import APPEND_DTYPE_TARGETS, Category, Policy, is_eligible, lstm_uses_onednn, op_key, promote_dtype

if TYPE_CHECKING:
    from graphamp.spec import AmpSpec

__all__ = ["insert_casts"]

_MAX_DECOMPOSITION_DEPTH = 6


def _autocast_state(node: Node, policy: Policy) -> tuple[bool, torch.dtype]:
    """(enabled, low dtype) for the policy's device at ``node``, from the regions around it."""
    enabled, dtype = True, policy.dtype
    for frame in region_of(node):
        if isinstance(frame, AutocastFrame) and frame.device_type == policy.device_type:
            enabled = frame.enabled
            if frame.dtype is not None:
                dtype = frame.dtype
    return enabled, dtype


def _tensor_kind(arg_type: torch.Type) -> str | None:
    """'tensor' for Tensor / Tensor?, 'list' for Tensor[]; autocast casts only these."""
    if isinstance(arg_type, torch.OptionalType):
        arg_type = arg_type.getElementType()
    if isinstance(arg_type, torch.TensorType):
        return "tensor"
    if isinstance(arg_type, torch.ListType) and isinstance(arg_type.getElementType(), torch.TensorType):
        return "list"
    return None


def _cast_slots(node: Node) -> list[tuple[str | int, int | None, Node]]:
    """Every (arg position or kwarg name, list index, input node) autocast's cached_cast would see."""
    schema = node.target._schema
    slots = []
    for i, sarg in enumerate(schema.arguments):
        if sarg.kwarg_only or i >= len(node.args):
            where: str | int = sarg.name
            value = node.kwargs.get(sarg.name)
        else:
            where, value = i, node.args[i]
        kind = _tensor_kind(sarg.type)
        if kind == "tensor" and isinstance(value, Node):
            slots.append((where, None, value))
        elif kind == "list" and isinstance(value, (list, tuple)):
            slots.extend((where, j, v) for j, v in enumerate(value) if isinstance(v, Node))
    return slots


def _replace_slot(node: Node, where: str | int, index: int | None, new: Node) -> None:
    if isinstance(where, int):
        args = list(node.args)
        args[where] = new if index is None else _replace_in(args[where], index, new)
        node.args = tuple(args)
    else:
        kwargs = dict(node.kwargs)
        kwargs[where] = new if index is None else _replace_in(kwargs[where], index, new)
        node.kwargs = kwargs


def _replace_in(seq: list | tuple, index: int, new: Node) -> list:
    out = list(seq)
    out[index] = new
    return out


def _first_arg(node: Node) -> Any:
    return val_of(node.args[0]) if node.args else None


def _is_decomposable(op: torch._ops.OpOverload) -> bool:
    # An op whose Autograd key has its own kernel redispatches below autocast; only pure
    # CompositeImplicitAutograd ops run their decomposition with autocast still active.
    name = op.name()
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd") and not (
        torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd")
    )


class _Rewriter:
    def __init__(self, gm: GraphModule, policy: Policy, config: Config, kernel_paths: bool = True, no_grad: bool = False) -> None:
        self.gm = gm
        self.kernel_paths = kernel_paths
        # The graph only ever runs under no_grad (spec.inference): its kernels need no backward.
        self.no_grad = no_grad
        self.graph = gm.graph
        self.policy = policy
        self.config = config
        self.fake_mode = fake_mode_of(gm)
        self.dirty: set[Node] = set()  # nodes whose dtypes changed since their consumers last saw them
        self.fresh: set[Node] = set()  # inlined nodes whose values were traced under eager's policy
        self.not_relevant: set[tuple] = set()  # decomposition signatures known to hold no listed op
        self.modified = False

    def run(self) -> None:
        node = next(iter(self.graph.nodes), None)
        while node is not None:
            node = self.visit(node)

    def visit(self, node: Node) -> Node | None:
        nxt = next_node(node)
        if node.op != "call_function":
            return nxt
        edited = False
        if isinstance(node.target, torch._ops.OpOverload) and not is_mutating(node.target):
            first_inlined = self.maybe_decompose(node)
            if first_inlined is not None:
                return first_inlined
            edited = self.apply_policy(node)
        if edited or node in self.fresh or any(a in self.dirty for a in node.all_input_nodes):
            old = dtypes_of(node.meta.get("val"))
            node.meta["val"] = recompute_val(node, self.fake_mode)
            if dtypes_of(node.meta["val"]) != old:
                self.dirty.add(node)
        return nxt

    def category_of(self, node: Node) -> tuple[Category | None, torch.dtype, str]:
        kept = self.config.keeps_fp32(node.meta.get("nn_module_stack"))
        if kept is not None:
            return Category.FP32, self.policy.dtype, f"inside {kept}, kept in fp32 by config"
        enabled, low = _autocast_state(node, self.policy)
        if not enabled:
            return None, low, "autocast disabled by a region in forward"
        key = op_key(node.target)
        category = self.policy.category(key)
        if category is None:
            return None, low, "not on an autocast list"
        if key in self.config.op_overrides:
            source = "config override"
        elif key in self.policy.opaque:
            if key == "lstm.input" and self.kernel_paths:
                return None, low, "decomposed along the kernel path eager takes for it"
            source = f"{self.policy.device_type} composite, run whole"
        else:
            source = f"{self.policy.device_type} list"
        return category, low, f"{category.value} ({source})"

    def apply_policy(self, node: Node) -> bool:
        category, low, reason = self.category_of(node)
        record = info(node)
        record.category, record.dtype, record.reason = category and category.value, None, reason
        if category is None:
            return False
        device = self.policy.device_type
        slots = _cast_slots(node)
        if category is Category.BANNED:
            if any(val_of(n).device.type == device for _, _, n in slots if isinstance(val_of(n), torch.Tensor)):
                raise BannedOpError(
                    f"{node.target} at node {node.name} ({_where(node)}) is banned under {device} autocast: "
                    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast. "
                    "Way out: use torch.nn.functional.binary_cross_entropy_with_logits or "
                    "torch.nn.BCEWithLogitsLoss, which combine the sigmoid and the loss and are safe, "
                    "or keep the loss in fp32 with Config(op_overrides={'binary_cross_entropy': 'fp32'})."
                )
            return False
        if category is Category.FP32_SET_OPT_DTYPE:
            return self.set_opt_dtype(node, device)
        if category is Category.FP32_APPEND_DTYPE:
            return self.append_dtype(node, device)
        if category is Category.LOWER_PRECISION_FP:
            to_type = low
        elif category is Category.FP32:
            to_type = torch.float32
        else:
            to_type = self.promote_type(node, slots, low, device)
        info(node).dtype = to_type
        edited = False
        for where, index, src in slots:
            val = val_of(src)
            if is_eligible(val, device) and val.dtype != to_type:
                cast = insert_cast(self.graph, src, to_type, node, self.fake_mode, f"{category.value} input of {node.name}")
                _replace_slot(node, where, index, cast)
                edited = True
        self.modified |= edited
        return edited

    def promote_type(self, node: Node, slots: list, low: torch.dtype, device: str) -> torch.dtype:
        dtypes = [
            val.dtype for val in (val_of(src) for _, _, src in slots)
            if isinstance(val, torch.Tensor) and val.device.type == device and val.is_floating_point()
        ]
        promoted = promote_dtype(dtypes, low)
        if promoted is None:
            other = next(d for d in dtypes if d not in (low, torch.float32, torch.float64))
            raise PromoteTypeError(
                f"{node.target} at node {node.name} ({_where(node)}) mixes {other} with the "
                f"autocast dtype {low}; eager autocast rejects this too ('Unexpected floating "
                "ScalarType in at::autocast::prioritize'). Way out: cast the operands to one dtype first."
            )
        return promoted

    def set_opt_dtype(self, node: Node, device: str) -> bool:
        if not is_eligible(_first_arg(node), device):
            return False
        schema = node.target._schema
        index = next(i for i, a in enumerate(schema.arguments) if a.name == "dtype")
        if index < len(node.args):
            if node.args[index] is not None:
                return False
            node.args = node.args[:index] + (torch.float32,) + node.args[index + 1 :]
        elif node.kwargs.get("dtype") is not None:
            return False
        else:
            node.kwargs = {**node.kwargs, "dtype": torch.float32}
        info(node).dtype = torch.float32
        self.modified = True
        return True

    def append_dtype(self, node: Node, device: str) -> bool:
        first = _first_arg(node)
        out_type = torch.float32 if is_eligible(first, device) else first.dtype
        old_schema = node.target._schema
        target = getattr(torch.ops.aten.norm, APPEND_DTYPE_TARGETS[op_key(node.target)].split(".", 1)[1])
        args = list(node.args)
        # Fill the positional defaults the dtype overload has no defaults for (keepdim).
        for i in range(len(args), len(old_schema.arguments)):
            sarg = old_schema.arguments[i]
            args.append(node.kwargs.get(sarg.name, sarg.default_value))
        node.target = target
        node.args = tuple(args)
        node.kwargs = {"dtype": out_type}
        info(node).dtype = out_type
        self.modified = True
        return True

    def maybe_decompose(self, node: Node) -> Node | None:
        """Replace an unlisted composite by its decomposition when that holds autocast-relevant ops."""
        op = node.target
        if not _is_decomposable(op):
            return None
        # AOTAutograd cannot trace mkldnn_rnn_layer's backward, so graphs it differentiates take
        # the kernel path only where the LSTM runs without grad.
        if op is torch.ops.aten.lstm.input and (self.kernel_paths or not self.grad_enabled(node)) and self.onednn_lstm_applies(node):
            sub, leaves = self.trace_onednn_lstm(node)
            if sub is not None:
                return self.inline(node, sub, leaves, "oneDNN (mkldnn_rnn_layer per layer and direction)")
        category, _, _ = self.category_of(node)
        enabled, _ = _autocast_state(node, self.policy)
        if category is not None or not enabled or op_key(op) in self.config.op_overrides:
            return None
        if self.config.keeps_fp32(node.meta.get("nn_module_stack")) is not None:
            return None
        if not any(is_eligible(val_of(n), self.policy.device_type) for n in node.all_input_nodes):
            return None
        low = _autocast_state(node, self.policy)[1]
        if op is torch.ops.aten.lstm.input:
            h, c = val_of(node.args[1])
            if h.shape[-1] != c.shape[-1]:
                warnings.warn(
                    f"nn.LSTM with proj_size at node {node.name} ({_where(node)}): eager runs it on native "
                    "C++ cells, whose projection recasts its weight every step; graphamp runs torch's "
                    "decomposition of those cells, which casts it once. Outputs are bitwise equal, but the "
                    "projection weights' gradients (weight_hr_*) may differ in rounding from eager autocast. "
                    "Way out: keep the LSTM in fp32 with Config(fp32_modules=(nn.LSTM,)) if they must be exact.",
                    EagerPathWarning,
                    stacklevel=2,
                )
        key = _signature(op, low, node.args, node.kwargs)
        if key in self.not_relevant:
            return None
        sub, leaves = self.trace_decomposition(op, node.args, node.kwargs, low)
        if sub is None or not self.is_relevant(op, sub, low, 0):
            self.not_relevant.add(key)
            return None
        return self.inline(node, sub, leaves)

    def onednn_lstm_applies(self, node: Node) -> bool:
        enabled, _ = _autocast_state(node, self.policy)
        if not enabled or "lstm.input" in self.config.op_overrides or self.config.keeps_fp32(node.meta.get("nn_module_stack")):
            return False
        input, (h, c) = val_of(node.args[0]), val_of(node.args[1])
        return self.policy.device_type == "cpu" and lstm_uses_onednn(
            input.dtype, projections=h.shape[-1] != c.shape[-1], grad_enabled=self.grad_enabled(node)
        )

    def grad_enabled(self, node: Node) -> bool:
        return not (self.no_grad or in_no_grad(node))

    def trace_onednn_lstm(self, node: Node) -> tuple[GraphModule | None, list]:
        """``aten::lstm`` as eager runs it on oneDNN: one ``mkldnn_rnn_layer`` per layer and
        direction, each of which autocast casts separately (a bidirectional layer casts its fp32
        input twice, and the two gradients meet in fp32).

        Pre-dispatch tracing records ``lstm`` itself, and symbolic sizes send it down the native
        path, so the kernel path is traced below autograd on static fake tensors of the example's
        sizes; nothing in it depends on those sizes (no size is an argument of its ops).
        """
        flat, spec = pytree.tree_flatten((node.args, node.kwargs))
        positions = [i for i, a in enumerate(flat) if isinstance(a, Node)]

        def lstm(*vals):
            filled = list(flat)
            for i, v in zip(positions, vals):
                filled[i] = v
            a, k = pytree.tree_unflatten(filled, spec)
            return torch.ops.aten.lstm.input(*a, **k)

        try:
            # use_mkldnn reads the grad mode (fp16 runs on oneDNN only without grad): the node's.
            with FakeTensorMode() as mode, torch.set_grad_enabled(self.grad_enabled(node)):
                inputs = [_static_fake(flat[i].meta["val"], mode) for i in positions]
                sub = make_fx(lstm)(*inputs)
        except Exception:
            return None, []
        sub.graph.eliminate_dead_code()  # the detached copies autograd's kernel makes
        if not any(n.target is torch.ops.aten.mkldnn_rnn_layer.default for n in sub.graph.nodes) or sub.graph.find_nodes(op="get_attr"):
            return None, []
        return sub, [flat[i] for i in positions]

    def trace_decomposition(self, op, args, kwargs, low: torch.dtype) -> tuple[GraphModule | None, list]:
        flat, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, a in enumerate(flat) if isinstance(a, Node)]
        inputs = [flat[i].meta.get("val") for i in positions]

        def decomposed(*vals):
            filled = list(flat)
            for i, v in zip(positions, vals):
                filled[i] = v
            a, k = pytree.tree_unflatten(filled, spec)
            # Pre-dispatch tracing's torch-function mode would re-record `op` itself; calling the
            # CompositeImplicitAutograd kernel without it records its children instead. The C++
            # kernel, as eager runs it: torch's Python decomposition of an op may differ
            # (upsample_bicubic2d.vec becomes index arithmetic in Python, while C++ calls the
            # upsample_bicubic2d kernel, which CPU autocast lists for fp32).
            with torch._C.DisableTorchFunction():
                try:
                    return op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *a, **k)
                except Exception:
                    return op.decompose(*a, **k)

        try:
            # Under autocast, as in eager: the decomposition's children see autocast's dtypes (a
            # mixed-dtype bmm inside einsum is legal there), while pre-dispatch tracing records
            # them above autocast, so no cast lands in the subgraph; the walk adds graphamp's own.
            with self.fake_mode, ambient_autocast(self.policy.device_type, low):
                sub = make_fx(decomposed, pre_dispatch=True)(*inputs)
        except Exception:
            return None, []
        return sub, [flat[i] for i in positions]

    def is_relevant(self, op, sub: GraphModule, low: torch.dtype, depth: int) -> bool:
        """Whether the decomposition holds a listed op, directly or inside a nested composite."""
        for child in sub.graph.nodes:
            if child.op != "call_function" or not isinstance(child.target, torch._ops.OpOverload):
                continue
            if child.target is op or is_mutating(child.target):
                continue
            if self.policy.category(op_key(child.target)) is not None:
                return True
            if depth < _MAX_DECOMPOSITION_DEPTH and _is_decomposable(child.target):
                key = _signature(child.target, low, child.args, child.kwargs)
                if key in self.not_relevant:
                    continue
                inner, _ = self.trace_decomposition(child.target, child.args, child.kwargs, low)
                if inner is not None and self.is_relevant(child.target, inner, low, depth + 1):
                    return True
                self.not_relevant.add(key)
        return False

    def inline(self, node: Node, sub: GraphModule, leaves: list[Node], eager_kernel: str | None = None) -> Node | None:
        after = next_node(node)
        copies = inline_subgraph(
            self.graph, node, sub.graph, leaves,
            lambda n: {**carried_meta(node, decomposed_from=node.name, eager_kernel=eager_kernel), "val": n.meta.get("val")},
        )
        self.fresh.update(copies)
        self.modified = True
        return copies[0] if copies else after


def _signature(op: torch._ops.OpOverload, low: torch.dtype, args: Any, kwargs: Any) -> tuple:
    """What a composite's decomposition can depend on: the op, the dtype, each tensor input's
    dtype/device/rank, and every constant argument (an einsum equation, a dim, a flag)."""

    def describe(leaf: Any) -> Any:
        if isinstance(leaf, Node):
            val = leaf.meta.get("val")
            if isinstance(val, torch.Tensor):
                return ("tensor", val.dtype, val.device.type, val.dim())
            return ("value", type(val).__name__)
        return ("const", repr(leaf))

    return (op, low, tuple(describe(leaf) for leaf in pytree.tree_leaves((args, kwargs))))


def _static_fake(val: Any, mode: FakeTensorMode) -> Any:
    """A fake tensor of ``val``'s dtype and device with the example's concrete sizes."""
    if not isinstance(val, torch.Tensor):
        return val
    size = [d.node.hint if isinstance(d, torch.SymInt) else d for d in val.shape]
    with mode:
        return torch.empty(size, dtype=val.dtype, device=val.device)


def _where(node: Node) -> str:
    innermost = innermost_module(node)
    if innermost is not None:
        path, type_ = innermost
        type_name = type_ if isinstance(type_, str) else type_.__qualname__
        return f"in module {path or '<root>'} ({type_name.rsplit('.', 1)[-1]})"
    return "at the top level of forward"


def insert_casts(gm: GraphModule, spec: AmpSpec) -> PassResult:
    """Insert explicit casts so every op receives the dtypes eager autocast would give it.

    For an AmpModule (``spec.target == "module"``) nn.LSTM follows the oneDNN kernel path eager
    takes (one ``mkldnn_rnn_layer`` per layer and direction); in graphs AOTAutograd traces, only
    where the LSTM runs without grad (AOTAutograd cannot trace that kernel's backward).
    """
    rewriter = _Rewriter(gm, spec.policy, spec.config, kernel_paths=spec.target == "module", no_grad=spec.inference)
    rewriter.run()
    if rewriter.modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, rewriter.modified)
