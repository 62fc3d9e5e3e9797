"""graphamp.export: ExportedPrograms equal to eager autocast that load and run without graphamp.

Structure first (no autocast region, no graphamp call, weights stored low), numerics second
(bitwise against eager autocast, in a fresh process that cannot import graphamp).
"""

from __future__ import annotations

import importlib
import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import decoder_zoo
import graphamp
from graphamp.testing import zoo

DTYPES = (torch.bfloat16, torch.float16)

# Runs in a fresh interpreter where importing graphamp fails: it loads each program (or AOTInductor
# package) and runs it on the saved inputs. transformers.modeling_outputs is imported only so that
# its output classes are registered with pytree, which loading a program that returns them needs.
_RUNNER = textwrap.dedent(
    """
    import sys

    class _NoGraphamp:
        def find_spec(self, name, path=None, target=None):
            if name == "graphamp" or name.startswith("graphamp."):
                raise ImportError("graphamp is not importable in this process")

    sys.meta_path.insert(0, _NoGraphamp())
    import torch
    try:
        import transformers.modeling_outputs  # noqa: F401
    except ImportError:
        pass
    from torch.utils import _pytree as pytree

    jobs = torch.load(sys.argv[1])
    results = []
    for path, kind, calls in jobs:
        if kind == "aoti":
            run = torch._inductor.aoti_load_package(path)
        else:
            run = torch.export.load(path).module()
        outs = []
        for args, kwargs in calls:
            with torch.no_grad():
                outs.append([t for t in pytree.tree_leaves(run(*args, **kwargs)) if isinstance(t, torch.Tensor)])
        results.append(outs)
    assert not any(m == "graphamp" or m.startswith("graphamp.") for m in sys.modules)
    torch.save(results, sys.argv[2])
    """
)


def run_without_graphamp(tmp_path, jobs: list[tuple[str, str, list]]) -> list[list[list[torch.Tensor]]]:
    """Run every (artifact path, "program" | "aoti", [(args, kwargs), ...]) in one fresh process."""
    jobs_path, out_path = tmp_path / "jobs.pt", tmp_path / "results.pt"
    torch.save(jobs, jobs_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(jobs_path), str(out_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out_path)


def eager_autocast(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype) -> list[torch.Tensor]:
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        out = model(*args, **kwargs)
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), f"output {i}: max abs diff {(a.float() - b.float()).abs().max().item()}"


def saved_size(ep: torch.export.ExportedProgram) -> int:
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    return len(buffer.getvalue())


def _bert_like(hidden: int = 64, layers: int = 2, vocab: int = 512) -> zoo.Case:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.BertConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=4 * hidden, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )

    def make(b: int, s: int) -> tuple[tuple, dict]:
        g = torch.Generator().manual_seed(1000 * b + s)
        mask = torch.ones(b, s, dtype=torch.long)
        mask[0, s // 2:] = 0  # padding: the mask is not all ones
        return (), {"input_ids": torch.randint(0, vocab, (b, s), generator=g), "attention_mask": mask}

    return zoo.Case("bert_like", tf.BertModel(cfg).eval(), make, batch=2, seq=8)


def _llama_like(**extra) -> zoo.Case:
    case = decoder_zoo.llama(**extra)
    case.model.eval()
    return case


MODELS = {"bert_like": _bert_like, "llama_like": _llama_like}
SIZES = ((1, 5), (3, 11))  # two batch sizes, other sequence lengths than the example's


@pytest.fixture(scope="module")
def exported():
    """Every model x dtype exported once, with its inputs at two sizes and eager autocast's outputs."""
    done = {}
    for name, factory in MODELS.items():
        case = factory()
        args, kwargs = case.inputs
        for dtype in DTYPES:
            ep = graphamp.export(case.model, args, kwargs, dtype=dtype)
            calls = [case.make_inputs(b, s) for b, s in SIZES]
            done[name, dtype] = ep, calls, [eager_autocast(case.model, a, k, dtype) for a, k in calls]
    return done


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_program_holds_plain_aten_and_low_weights(exported, name, dtype):
    ep, _, _ = exported[name, dtype]
    targets = {n.target for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes if n.op == "call_function"}
    assert torch.ops.higher_order.wrap_with_autocast not in targets
    assert not [t for t in targets if getattr(t, "__module__", "").startswith("graphamp")]
    assert torch.ops.aten._to_copy.default in targets  # the casts are in the program
    low = [k for k, v in ep.state_dict.items() if v.dtype == dtype]
    assert any(k.endswith("query.weight") or k.endswith("q_proj.weight") for k in low)
    norms = [k for k in ep.state_dict if "norm" in k.lower()]
    assert norms and all(ep.state_dict[k].dtype == torch.float32 for k in norms)  # autocast runs norms in fp32
    assert ep.range_constraints and all(r.lower <= 1 for r in ep.range_constraints.values())  # batch 1 allowed


def test_roundtrip_without_graphamp_is_bitwise(exported, tmp_path):
    """Acceptance: save -> load where graphamp is not importable -> bitwise equal to eager autocast,
    BERT-like and Llama-like, bf16 and fp16, two batch sizes."""
    jobs, wants = [], []
    for (name, dtype), (ep, calls, want) in exported.items():
        path = str(tmp_path / f"{name}_{str(dtype)[6:]}.pt2")
        torch.export.save(ep, path)
        jobs.append((path, "program", calls))
        wants.append(want)
    results = run_without_graphamp(tmp_path, jobs)
    for (key, got_per_call), want_per_call in zip(zip(exported, results), wants):
        for got, want in zip(got_per_call, want_per_call):
            assert_bitwise(got, want)


@pytest.mark.parametrize("name", list(MODELS))
def test_saved_program_is_at_most_055_of_fp32(name):
    """Weights autocast uses only in low precision are stored low: the saved program is <= 0.55x the
    fp32 export. Sizes where the weights, not the graph's text, make the file (hidden 512)."""
    extra = {"hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8} if name == "llama_like" else {"hidden": 512}
    case = MODELS[name](**extra)
    args, kwargs = case.inputs
    fp32 = saved_size(torch.export.export(case.model, args, kwargs))
    low = saved_size(graphamp.export(case.model, args, kwargs, dtype=torch.bfloat16, dynamic=False))
    assert low <= 0.55 * fp32, (low, fp32, low / fp32)


def test_keep_io_types_returns_fp32_equal_to_eager_float():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(4, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        want = model(x)
    assert want.dtype is torch.float16
    for run in (
        graphamp.convert(model, (x,), dtype=torch.float16, keep_io_types=True),
        graphamp.export(model, (x,), dtype=torch.float16, keep_io_types=True).module(),
    ):
        got = run(x)
        assert got.dtype is torch.float32 and torch.equal(got, want.float())
    plain = graphamp.export(model, (x,), dtype=torch.float16).module()(x)
    assert plain.dtype is torch.float16


def test_keep_io_types_takes_fp32_for_low_inputs_and_trains():
    """A model fed bf16 inputs: with keep_io_types it takes fp32 and casts inside; gradients flow."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x.bfloat16())
    amp = graphamp.convert(model, (x.bfloat16(),), keep_io_types=True)
    got = amp(x)
    assert got.dtype is torch.float32 and torch.equal(got, want.float())
    with pytest.raises(graphamp.InputMismatchError):
        amp(x.bfloat16())  # the interface is fp32 now
    got.sum().backward()
    assert model[0].weight.grad is not None


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_keep_io_types_must_be_bool(bad):
    model = nn.Linear(2, 2)
    for frontend in (graphamp.convert, graphamp.export):
        with pytest.raises(TypeError, match="keep_io_types must be True or False"):
            frontend(model, (torch.randn(1, 2),), keep_io_types=bad)


class _Branchy(nn.Module):
    """Data-dependent control flow on a value no ATen assertion can check (int() truncates a float)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if int(y.sum()) > 0 else y


def test_data_dependent_control_flow_no_assertion_checks_is_an_export_error():
    with pytest.raises(graphamp.ExportError, match="reads tensor values.*no ATen assertion.*Way out"):
        graphamp.export(_Branchy(), (torch.randn(2, 4),))


class _SelectsRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows = x[mask]  # a size that depends on values
        if rows.shape[0] > 1:  # and a branch on it: torch.export refuses the model
            rows = self.lin(rows)
        return rows.sum(0)


def test_data_dependent_code_is_exported_from_the_capture_on_values_with_its_conditions_asserted():
    # As convert does, export captures such a model on the example's values; the sizes and values
    # its code read become assertions in the program (before: CaptureError).
    torch.manual_seed(0)
    model, x = _SelectsRows().eval(), torch.randn(6, 4)
    mask = torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool)
    program = graphamp.export(model, (x, mask))
    same_count = torch.tensor([0, 1, 1, 0, 1, 0], dtype=torch.bool)
    for m in (mask, same_count):
        assert graphamp.verify_export(program, model, (torch.randn(6, 4), m)) == ""
    other_count = (x, torch.ones(6, dtype=torch.bool))
    # another count of rows: refused, never run, with graphamp's words before torch's own assertion
    with pytest.raises(RuntimeError, match=r"^graphamp.export: this program follows the example's values.*Runtime assertion failed.*Way out"):
        program.module()(*other_count)
    with pytest.raises(graphamp.InputValueError, match="the program refuses these inputs"):
        graphamp.verify_export(program, model, other_count)
    saved = io.BytesIO()
    torch.export.save(program, saved)
    saved.seek(0)
    with pytest.raises(graphamp.InputValueError, match="refuses these inputs. graphamp.export: this program follows"):
        graphamp.verify_export(torch.export.load(saved), model, other_count)  # a saved program keeps the words


class _Ste(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g


class _GeluMatmul(torch.autograd.Function):
    """A Function whose forward autocast reaches in eager (a matmul), as BLOOM's GeLU is one."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.nn.functional.gelu(x @ w, approximate="tanh")

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Fp32Inside(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, w):
        return (x @ w).softmax(-1)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        return g, None


class _WithFunctions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.lin(x)
        return _Ste.apply(y), _GeluMatmul.apply(y, self.w), _Fp32Inside.apply(y, self.w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_custom_functions_are_traced_through_into_a_program_without_graphamp(dtype):
    # convert keeps a Function whole for its own backward; a program runs none, and may not call
    # graphamp: each forward is traced as eager runs it (autocast inside, custom_fwd's fp32 region).
    torch.manual_seed(0)
    model, x = _WithFunctions().eval(), torch.randn(3, 4)
    ep = graphamp.export(model, (x,), dtype=dtype)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        expected = model(x)
    got = ep.module()(x)
    assert [t.dtype for t in got] == [dtype, dtype, torch.float32]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not any("graphamp" in str(n.target) for n in ep.graph.nodes)


def test_export_leaves_the_model_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    before = {k: (v.dtype, v.clone()) for k, v in model.state_dict().items()}
    graphamp.export(model, (torch.randn(2, 4),), dtype=torch.float16)
    after = model.state_dict()
    assert all(after[k].dtype == d and torch.equal(after[k], v) for k, (d, v) in before.items())
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())


def aoti_mlp() -> zoo.Case:
    """An MLP whose ops inductor leaves to ATen kernels (mm) or fuses elementwise: no reductions of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    return zoo.Case("aoti_mlp", model, lambda b, s: ((torch.randn(b, 16, generator=torch.Generator().manual_seed(b)),), {}))


def aoti_bert() -> zoo.Case:
    return _bert_like()


def test_cli_writes_program_and_aoti_package_that_run_without_graphamp(tmp_path, capsys):
    """`graphamp export` writes an ExportedProgram and (--aoti) an AOTInductor package; both load in a
    process without graphamp. The program is bitwise; behind inductor the bf16 outputs are bitwise and
    the fp32 ones (after layer_norm, whose reduction inductor generates) within 1e-6 (measured 4.8e-7)."""
    from graphamp.cli.main import main

    program, package = tmp_path / "mlp.pt2", tmp_path / "bert_aoti.pt2"
    assert main(["export", "--model", "test_export:aoti_mlp", "--out", str(program), "--dtype", "fp16", "--keep-io-types"]) == 0
    assert main(["export", "--model", "test_export:aoti_bert", "--out", str(package), "--aoti"]) == 0  # ~25-45 s
    assert "AOTInductor package" in capsys.readouterr().out
    mlp, bert = aoti_mlp(), aoti_bert()
    mlp_calls, bert_calls = [mlp.make_inputs(b, s) for b, s in SIZES], [bert.make_inputs(b, s) for b, s in SIZES]
    results = run_without_graphamp(tmp_path, [(str(program), "program", mlp_calls), (str(package), "aoti", bert_calls)])
    for got, (args, kwargs) in zip(results[0], mlp_calls):
        assert_bitwise(got, [t.float() for t in eager_autocast(mlp.model, args, kwargs, torch.float16)])
    for got, (args, kwargs) in zip(results[1], bert_calls):
        want = eager_autocast(bert.model, args, kwargs, torch.bfloat16)
        assert [t.dtype for t in got] == [torch.float32, torch.bfloat16] == [t.dtype for t in want]
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)


def test_cli_reports_a_model_it_cannot_export(tmp_path, capsys):
    from graphamp.cli.main import main

    assert main(["export", "--model", "test_export:branchy", "--out", str(tmp_path / "x.pt2")]) == 1
    captured = capsys.readouterr()
    assert "ExportError" in captured.err and "Way out" in captured.err and captured.out == ""
    assert not (tmp_path / "x.pt2").exists()


def branchy() -> tuple[nn.Module, tuple]:
    return _Branchy(), (torch.randn(2, 4),)


def test_a_value_eager_reads_is_an_assertion_in_the_exported_program(tmp_path):
    # Exported on a padded example, the program adds the padding bias; eager skips it for an
    # unpadded mask by reading the mask's values (transformers' all-ones check). A deployed program
    # cannot call graphamp's guard, so it asserts the read in ATen: the unpadded input is refused
    # (ExportedProgram and after save/load), never run down the example's path; padded ones run exact.
    from test_grad_regressions import MaskedEncoder, _inputs

    model = MaskedEncoder(skip_bias_without_padding=True).eval()
    args, _ = _inputs(padded=True)
    ep = graphamp.export(model, args, dtype=torch.bfloat16)
    code = ep.graph_module.code
    assert "_assert_async" in code and "graphamp.runtime" not in code and "guard_value" not in code
    path = tmp_path / "masked.pt2"
    torch.export.save(ep, path)
    run = torch.export.load(path).module()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(*args)
    assert torch.equal(run(*args), want)
    unpadded, _ = _inputs(padded=False)
    with pytest.raises(RuntimeError, match="graphamp.export: the model's code reads a tensor value"):
        run(*unpadded)


def _census_model(name: str) -> tuple[nn.Module, tuple, dict]:
    """The census's tiny random-weight build of ``name`` whose eager autocast runs, in eval mode."""
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        import census_models
    finally:
        sys.path.pop(0)
    for attempt in range(census_models.attempts(name)):
        try:
            built = census_models.build(name, attempt)
            args, kwargs = built.make_inputs(census_models.BATCH)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                built.model.eval()(*args, **kwargs)
        except Exception:
            continue
        return built.model, args, kwargs
    pytest.skip(f"no build of {name} runs under eager autocast with this transformers")


def test_a_program_that_differs_from_eager_is_exported_from_the_capture_on_values(tmp_path):
    # transformers' PaliGemma: traced by torch.export, its mask code builds another attention
    # program than eager's (which reads the mask's values), and the program differs from eager
    # autocast. The self-check finds it and exports the capture on the example's values, where
    # what the code read is an ATen assertion: bitwise, and loadable without graphamp.
    model, args, kwargs = _census_model("hf/paligemma")
    first = graphamp.export(model, args, kwargs, self_check="off")
    assert "differs" in graphamp.verify_export(first, model, args, kwargs)
    ep = graphamp.export(model, args, kwargs)
    assert "graphamp.runtime" not in ep.graph_module.code
    path = tmp_path / "paligemma.pt2"
    torch.export.save(ep, path)
    assert graphamp.verify_export(torch.export.load(path), model, args, kwargs) == ""  # a saved program, checked


def test_a_difference_no_fallback_removes_is_an_export_error_or_a_warning(monkeypatch):
    import sys

    export_module = sys.modules["graphamp.export"]  # the module; graphamp.export is the function
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).eval()
    x = torch.randn(4, 8)
    monkeypatch.setattr(export_module, "verify_export", lambda *a, **k: "output[0] differs (max abs difference 0.5)")
    with pytest.raises(graphamp.ExportError, match="self-check.*output\\[0\\] differs.*Way out"):
        graphamp.export(model, (x,))
    with pytest.warns(graphamp.PolicyDriftWarning, match="output\\[0\\] differs"):
        ep = graphamp.export(model, (x,), self_check="warn")
    assert isinstance(ep, torch.export.ExportedProgram)
    graphamp.export(model, (x,), self_check="off")  # no check, no warning
    with pytest.raises(ValueError):
        graphamp.export(model, (x,), self_check="sometimes")


def test_verify_export_names_a_dtype_difference():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    x = torch.randn(4, 8)
    ep = graphamp.export(model, (x,), keep_io_types=True)
    # keep_io_types returns fp32: compared against eager without keep_io_types, the dtype differs
    assert "float32" in graphamp.verify_export(ep, model, (x,)) and "bfloat16" in graphamp.verify_export(ep, model, (x,))
    assert graphamp.verify_export(ep, model, (x,), keep_io_types=True) == ""


def test_where_the_capture_on_values_fails_too_torch_exports_refusal_is_raised_with_its_reason(monkeypatch):
    # Before: the values capture's own error alone, which hides why export tried it (t5gemma2's
    # "Current active mode ... not registered" from transformers' vmap mask code).
    export_module = importlib.import_module("graphamp.export")  # graphamp.export is the function
    real = export_module._export

    def values_capture_fails(model, args, kwargs, spec, dynamic):
        if spec.capture == "values":
            raise graphamp.CaptureError("the values capture cannot run this code")
        return real(model, args, kwargs, spec, dynamic)

    monkeypatch.setattr(export_module, "_export", values_capture_fails)
    model, x = _SelectsRows().eval(), torch.randn(6, 4)
    mask = torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool)
    with pytest.raises(graphamp.CaptureError) as raised:
        graphamp.export(model, (x, mask))
    text = str(raised.value)
    assert text.splitlines()[0] != "the values capture cannot run this code"  # torch.export's refusal comes first
    assert "failed too: CaptureError: the values capture cannot run this code" in text
    assert isinstance(raised.value.__cause__, graphamp.CaptureError)


class _LoopsOverUniqueRows(nn.Module):
    """A change of state, then a Python loop over value-sized values (``nonzero().unique()``, as
    ViLT's patch sampling) with a read inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)  # the capture moves its guards before this, with copies of what they read
        out = x.sum(0)
        for r in mask.nonzero()[:, 0].unique():
            if bool((x[r] > 0).any()):
                out = out + self.lin(x[r])
        return out


def test_a_loop_over_value_sized_values_after_a_change_of_state_is_exported():
    # Before: ExportError (GuardOnDataDependentSymNode): the guards moved before the change of state
    # read copies of the unique op without their size guards, which torch.export cannot size.
    torch.manual_seed(0)
    model, x = _LoopsOverUniqueRows().eval(), torch.randn(6, 4)
    mask = torch.tensor([[1, 0], [0, 0], [1, 1], [0, 0], [0, 1], [0, 0]], dtype=torch.bool)
    program = graphamp.export(model, (x, mask))
    assert graphamp.verify_export(program, model, (x, mask)) == ""
    amp = graphamp.convert(model, (x, mask), inference=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x, mask)
    assert torch.equal(amp(x, mask), want)
