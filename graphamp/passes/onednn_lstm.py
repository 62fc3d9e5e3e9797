"""Trace ``aten::lstm`` along the oneDNN kernel path eager takes on CPU: one ``mkldnn_rnn_layer``
per layer and direction, each of which autocast casts separately."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from graphamp.config import Config
from graphamp.passes.classify import autocast_state
from graphamp.passes.graph_edit import val_of
from graphamp.policy import Policy, lstm_uses_onednn

__all__ = ["onednn_lstm_applies", "trace_onednn_lstm"]


def onednn_lstm_applies(node: Node, policy: Policy, config: Config, *, grad_enabled: bool) -> bool:
    """Whether eager autocast runs the ``aten::lstm`` at ``node`` on oneDNN (and not on its native
    C++ cells), which depends on the device, the input dtype, projections and the grad mode."""
    enabled, _ = autocast_state(node, policy)
    if not enabled or "lstm.input" in config.all_overrides or config.keeps_fp32(node.meta.get("nn_module_stack")):
        return False
    input, (h, c) = val_of(node.args[0]), val_of(node.args[1])
    return policy.device_type == "cpu" and lstm_uses_onednn(
        input.dtype, projections=h.shape[-1] != c.shape[-1], grad_enabled=grad_enabled
    )


def trace_onednn_lstm(node: Node, *, grad_enabled: bool) -> tuple[GraphModule | None, list]:
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
        # Eager's kernel copies a strided input (or state) into a contiguous one before oneDNN reads
        # it; on the contiguous fakes below that copy is not traced, and oneDNN misreads the strided
        # tensors of a later call (an nn.LSTM fed a permuted activation): made explicit, for any strides.
        a = (_contiguous(a[0]), [_contiguous(t) for t in a[1]], *a[2:])
        return torch.ops.aten.lstm.input(*a, **k)

    try:
        # use_mkldnn reads the grad mode (fp16 runs on oneDNN only without grad): the node's.
        with FakeTensorMode() as mode, torch.set_grad_enabled(grad_enabled):
            inputs = [_static_fake(flat[i].meta["val"], mode) for i in positions]
            sub = make_fx(lstm)(*inputs)
    except Exception:
        return None, []
    sub.graph.eliminate_dead_code()  # the detached copies autograd's kernel makes
    if not any(n.target is torch.ops.aten.mkldnn_rnn_layer.default for n in sub.graph.nodes) or sub.graph.find_nodes(op="get_attr"):
        return None, []
    return sub, [flat[i] for i in positions]


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.clone.default(t, memory_format=torch.contiguous_format)


def _static_fake(val: Any, mode: FakeTensorMode) -> Any:
    """A fake tensor of ``val``'s dtype and device with the example's concrete sizes."""
    if not isinstance(val, torch.Tensor):
        return val
    size = [d.node.hint if isinstance(d, torch.SymInt) else d for d in val.shape]
    with mode:
        return torch.empty(size, dtype=val.dtype, device=val.device)
