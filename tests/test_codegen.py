"""codegen: the converted module's code reads its state in one call and calls overloads directly,
and still sees every change to its parameters; saved files keep FX's own code."""

import copy
import io

import pytest
import torch
from torch import nn
from torch.fx.graph import _format_target as fx_format_target

import graphamp
from graphamp.codegen import READ_METHOD, _format_target, _read_of, binding_for, call_overloads_directly, hoist_state_reads
from graphamp.runtime import read_state


@pytest.mark.parametrize("target", ["weight", "lin.weight", "blocks.0.weight", "a.0.1.b", "_tensor_constant0", "x.1-2"])
def test_our_reading_of_fx_attribute_code_matches_fx(target):
    # FX's private formatter is what writes these lines: if it changes, this fails (not the code).
    rhs = fx_format_target("self", target)
    assert _format_target("self", target) == rhs
    assert _read_of(f"w = {rhs}") == ("w", tuple(target.split(".")))


def test_runs_of_reads_become_one_call_and_other_lines_stay():
    body = [
        "# COUNTER: 0\n", 'a = getattr(self.blocks, "0").weight', "\n",
        "# COUNTER: 1\n", 'b = getattr(self.blocks, "0").bias', "\n",
        "# COUNTER: 2\n", "y = torch.ops.aten.linear.default(x, a, b)", ";  a = b = None\n",
        "# COUNTER: 3\n", "c = self.scale", "\n",                  # a run of one stays as FX wrote it
        "# COUNTER: 4\n", "unused = self.lin.weight", ";  unused = None\n",   # FX deletes it on its line
        "# COUNTER: 5\n", "z : torch.Tensor = self.lin.bias", "\n",  # annotated: not FX's plain form
        "# COUNTER: 6\n", "q = self.guard(y)", "\n",                # a call_module line
    ]
    out = hoist_state_reads(body)
    code = "".join(out)
    assert "(\n    a, b,\n) = self._graphamp_read(\n    ('blocks', '0', 'weight'), ('blocks', '0', 'bias'),\n)\n" in code
    for kept in ("c = self.scale", "unused = self.lin.weight;  unused = None", "z : torch.Tensor = self.lin.bias", "q = self.guard(y)"):
        assert kept in code
    assert code.index("# COUNTER: 0") < code.index("_graphamp_read") < code.index("# COUNTER: 2")


def test_only_plain_overload_calls_are_made_directly():
    body = [
        "y = torch.ops.aten.linear.default(x, w)", "\n",
        "z = graphamp_runtime_autocast_op(torch.ops.aten.linear.default, 'cpu', x)", "\n",  # an op as a value
        "q = torch.ops.aten.no_such_op.default(x)", "\n",  # unresolvable: left alone
        "r = torch.ops.higher_order.wrap_with_autocast(f, x)", "\n",  # not a namespace.op.overload call
    ]
    out = call_overloads_directly(body)
    assert out[0] == "y = torch.ops.aten.linear.default._op(x, w)"
    assert out[2:] == body[2:]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.norm = nn.LayerNorm(8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(self.norm(x)))
        return x * self.scale


def _eager(model, x, dtype=torch.bfloat16):
    with torch.autocast("cpu", dtype=dtype):
        return model(x)


@pytest.fixture
def converted():
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(4, 8)
    return model, x, graphamp.convert(model, (x,))


def test_converted_code_reads_state_once_and_calls_overloads_directly(converted):
    model, x, amp = converted
    assert getattr(type(amp), READ_METHOD) is read_state
    assert "self._graphamp_read(" in amp.code and "getattr(self.blocks" not in amp.code
    assert "torch._C._nn.linear(" in amp.code
    assert torch.equal(amp(x), _eager(model, x))


def test_every_change_to_the_state_is_seen(converted):
    model, x, amp = converted
    # A parameter replaced by assignment, a buffer re-registered, a submodule swapped.
    amp.get_submodule("blocks.1").weight = nn.Parameter(torch.randn(8, 8))
    model.blocks[1].weight = amp.get_submodule("blocks.1").weight
    amp.register_buffer("scale", torch.full((8,), 3.0))
    model.register_buffer("scale", amp.scale)
    new = nn.Linear(8, 8)
    setattr(amp.blocks, "2", new)  # the converted module's containers are plain nn.Modules
    model.blocks[2] = new
    assert torch.equal(amp(x), _eager(model, x))
    # load_state_dict(assign=True) puts new Parameter objects in place, here in both.
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        owner, _, attr = name.rpartition(".")
        setattr(amp.get_submodule(owner), attr, tensor)
    assert torch.equal(amp(x), _eager(model, x))
    # In the converted module only: the model (and its optimizer) no longer hold what it reads.
    amp.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    with pytest.raises(graphamp.ModelChangedError, match="blocks"):
        amp(x)


def test_parameters_replaced_by_apply_are_seen(converted):
    model, x, amp = converted
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        before = amp.get_parameter("blocks.0.weight")
        amp.float()  # _apply writes new Parameter objects straight into _parameters
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert amp.get_parameter("blocks.0.weight") is not before
    with torch.no_grad():
        amp.get_parameter("blocks.0.weight").mul_(2)
        model.blocks[0].weight.mul_(2)
    assert torch.equal(amp(x), _eager(model, x))


def test_saved_files_keep_fx_code_and_load_with_fast_code(converted):
    model, x, amp = converted
    _, (body, _imports) = amp.__reduce__()
    assert "_graphamp_read" not in body["_code"] and "._op(" not in body["_code"]
    assert "_graphamp_traceable" not in body
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert "self._graphamp_read(" in loaded.code and "._op(" in loaded.code
    assert torch.equal(loaded(x), amp(x))
    clone = copy.deepcopy(amp)  # a copy as torch.save/torch.load makes one
    assert clone.code == loaded.code and torch.equal(clone(x), amp(x))


def test_dynamo_traces_the_code_without_direct_calls(converted):
    model, x, amp = converted
    torch._dynamo.reset()
    compiled = torch.compile(amp, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), amp(x))


def test_read_state_follows_module_attribute_order():
    m = nn.Module()
    m.lin = nn.Linear(2, 2)
    m.register_buffer("buf", torch.ones(1))
    m.const = torch.zeros(1)  # a plain tensor attribute (as export's lifted constants)
    values = read_state(m, ("lin", "weight"), ("buf",), ("const",), ("lin",), ("lin", "in_features"))
    assert values[0] is m.lin.weight and values[1] is m.buf and values[2] is m.const
    assert values[3] is m.lin and values[4] == 2
    with pytest.raises(AttributeError):
        read_state(m, ("lin", "missing"))


def _node(target, *args):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    y = g.placeholder("y")  # no value: as in a loaded module's graph
    nodes = {"x": x, "y": y}
    return g.call_function(target, tuple(nodes.get(a, a) if isinstance(a, str) else a for a in args))


@pytest.mark.parametrize(
    "target, args, binding",
    [
        (torch.ops.aten.add.Tensor, ("x", "x"), "torch._C._VariableFunctions.add"),
        (torch.ops.aten.linear.default, ("x", "x"), "torch._C._nn.linear"),  # composite: same decomposition
        (torch.ops.aten.sum.dim_IntList, ("x", [1]), "torch._C._VariableFunctions.sum"),
        (torch.ops.aten.view.default, ("x", [32]), "torch._C.TensorBase.view"),
        # torch.add(x, 2) would dispatch add.Tensor with a wrapped number, not add.Scalar.
        (torch.ops.aten.add.Scalar, ("x", 2), None),
        (torch.ops.aten.add_.Tensor, ("x", "x"), None),  # mutating ops keep the overload
        (torch.ops.aten.tanh.default, ("y",), None),  # no fake value to probe with
    ],
)
def test_a_binding_is_taken_only_where_it_dispatches_the_same_call(target, args, binding):
    assert binding_for(_node(target, *args)) == binding


def test_converted_code_calls_verified_bindings_and_the_rest_directly(converted):
    model, x, amp = converted
    assert "torch._C._nn.linear(" in amp.code and "torch._C._VariableFunctions.tanh(" in amp.code
    assert "torch.ops.aten._to_copy.default._op(" in amp.code  # no binding of _to_copy
    body = [line for line in amp.code.splitlines() if " = torch.ops." in line]
    assert all("._op(" in line for line in body)


def test_graphs_off_the_cpu_keep_their_overload_calls():
    # A hand-written binding (Tensor.contiguous) takes a device guard the boxed call does not, which a
    # CPU-only torch cannot for CUDA (verify's fake CUDA tensors): only CPU nodes get bindings.
    node = _node(torch.ops.aten.add.Tensor, "x", "x")
    assert binding_for(node) == "torch._C._VariableFunctions.add"
    node.args[0].meta["val"] = torch.empty(4, 8, device="meta")  # a device other than the CPU
    assert binding_for(node) is None
