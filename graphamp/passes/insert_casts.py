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
each cast records why. The category is decided in :mod:`graphamp.passes.classify`, composites
are replaced in :mod:`graphamp.passes.decompose`; this module applies the decision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphamp.config import Config
from graphamp.errors import BannedOpError, PromoteTypeError
from graphamp.passes.classify import Decision, classify, location
from graphamp.passes.decompose import Decomposer
from graphamp.passes.fuse_encoder_layers import FUSED, fused_value
from graphamp.runtime import autocast_op
from graphamp.passes.graph_edit import (
    dtypes_of,
    fake_mode_of,
    insert_cast,
    is_mutating,
    next_node,
    recompute_val,
    val_of,
)
from graphamp.node_info import info, peek
from graphamp.policy import APPEND_DTYPE_TARGETS, Category, Policy, is_eligible, op_key, promote_dtype

if TYPE_CHECKING:
    from graphamp.spec import AmpSpec

__all__ = ["insert_casts"]


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


class _Rewriter:
    """Walks the graph in order: decomposes what eager decomposes, then casts each op's inputs as
    its category says; the decision itself is :meth:`category_of` (autotune overrides it)."""

    def __init__(self, gm: GraphModule, policy: Policy, config: Config, kernel_paths: bool = True, no_grad: bool = False) -> None:
        self.gm = gm
        self.kernel_paths = kernel_paths
        # The graph only ever runs under no_grad (spec.inference): its kernels need no backward.
        self.no_grad = no_grad
        self.graph = gm.graph
        self.policy = policy
        self.config = config
        self.fake_mode = fake_mode_of(gm)
        self.decomposer = Decomposer(gm, policy, config, self.category_of, self.fake_mode, kernel_paths=kernel_paths, no_grad=no_grad)
        self.dirty: set[Node] = set()  # nodes whose dtypes changed since their consumers last saw them
        self.fresh: set[Node] = set()  # inlined nodes whose values were traced under eager's policy
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
            copies = self.decomposer.decompose(node)
            if copies is not None:
                self.fresh.update(copies)
                self.modified = True
                return copies[0] if copies else nxt
            edited = self.apply_policy(node) or self.stale(node)
        if edited or node in self.fresh or any(a in self.dirty for a in node.all_input_nodes):
            old = dtypes_of(node.meta.get("val"))
            fused = node.target is autocast_op and node.args[0] is FUSED
            node.meta["val"] = fused_value(node, self.fake_mode) if fused else recompute_val(node, self.fake_mode)
            if dtypes_of(node.meta["val"]) != old:
                self.dirty.add(node)
        return nxt

    def stale(self, node: Node) -> bool:
        """Whether the node's value has a floating dtype other than the one its category computes in:
        captured values carry eager autocast's dtypes, so an op a config moves off autocast's dtype
        whose inputs need no cast (a linear kept in fp32 on fp32 inputs) is re-derived all the same."""
        record = peek(node)
        return record is not None and record.dtype is not None and any(
            d is not None and d.is_floating_point and d != record.dtype for d in dtypes_of(node.meta.get("val"))[:1]
        )

    def category_of(self, node: Node) -> Decision | tuple[Category | None, torch.dtype, str]:
        return classify(node, self.policy, self.config, kernel_paths=self.kernel_paths)

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
                    f"{node.target} at node {node.name} ({location(node)}) is banned under {device} autocast: "
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
                f"{node.target} at node {node.name} ({location(node)}) mixes {other} with the "
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
