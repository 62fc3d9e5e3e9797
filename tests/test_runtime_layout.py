"""The runtime's own modules (``graphamp.runtime_*``) stay behind its stable path.

``graphamp.runtime`` defines some of its names in modules of its own. Generated code and saved
files must still name each by ``graphamp.runtime`` (``tests/test_runtime.py`` checks a saved
module's names; this checks every name, also the ones that model does not reach), and those
modules must stay as light as the runtime: torch, the standard library and ``graphamp.errors``.
"""

from __future__ import annotations

import ast
import io
import pickle
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import graphamp
from graphamp import runtime

PACKAGE = Path(graphamp.__file__).parent
# What the runtime may import from graphamp: its errors, and the runtime's own modules.
RUNTIME_LAYER = {"graphamp.runtime", "graphamp.runtime_autocast", "graphamp.runtime_guards", "graphamp.runtime_saved"}


def _imports(module: str) -> tuple[set[str], set[str]]:
    """(modules imported at module level, modules imported inside functions), graphamp's resolved
    to modules (``from graphamp import runtime_guards`` is graphamp.runtime_guards)."""
    tree = ast.parse((PACKAGE / (module.split(".", 1)[1] + ".py")).read_text())
    in_functions = {
        id(sub) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for sub in ast.walk(node) if sub is not node
    }
    top, local = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            names = {f"{base}.{a.name}" if (PACKAGE / f"{a.name}.py").exists() and base == "graphamp" else base for a in node.names}
        else:
            continue
        (local if id(node) in in_functions else top).update(names)
    return top, local


def test_every_stable_name_is_named_by_the_stable_path():
    # FX writes a function's __module__ into a converted module's imports and pickle a class's into
    # a saved file; a saved node record keys function calls by it too (runtime_saved.node_key).
    for name in runtime.__all__:
        obj = getattr(runtime, name)
        assert obj.__module__ == "graphamp.runtime", f"graphamp.runtime.{name} is named {obj.__module__}.{name}"


def test_the_runtime_layer_imports_torch_and_graphamp_errors_only():
    seen, todo = set(), ["graphamp.runtime"]
    while todo:
        module = todo.pop()
        seen.add(module)
        top, local = _imports(module)
        for name in top:
            root = name.split(".")[0]
            if root == "graphamp":
                assert name in RUNTIME_LAYER | {"graphamp.errors"}, f"{module} imports {name}, a compile-time module"
                if name in RUNTIME_LAYER and name not in seen:
                    todo.append(name)
            else:
                assert root == "torch" or root in sys.stdlib_module_names or root == "__future__", f"{module} imports {name}"
        # rebuild_amp_module finds graphamp.AmpModule through the package, loaded already by then.
        assert local <= {"graphamp"}, f"{module} imports {local - {'graphamp'}} inside a function"
    assert seen == RUNTIME_LAYER


def _generated_imports(target, *args) -> str:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(target, (x, *args)))
    _, (_, import_block) = torch.fx.GraphModule(nn.Module(), graph).__reduce__()
    return import_block


@pytest.mark.parametrize(
    "name",
    ["set_grad_enabled", "cached_cast", "autocast_cached", "apply_function", "apply_graph_function", "autocast_op",
     "guard_value", "guard_size"],
)
def test_generated_code_imports_runtime_calls_from_the_stable_path(name):
    assert f"from graphamp.runtime import {name}" in _generated_imports(getattr(runtime, name))


@pytest.mark.parametrize(
    "value",
    [
        runtime.Slot(0),
        runtime.AutocastState("cpu", True, torch.bfloat16),
        runtime.PartialTemplate(dict, None, (), {}),
        runtime.FrozenDict(a=1),
        runtime.InputGuard(["x"], [(torch.float32, "cpu", [2, "s0"])], {"s0": (2, None)}, conditions=[("s0 != 1", ("s0",), "here")]),
    ],
    ids=lambda v: type(v).__name__,
)
def test_pickled_values_name_the_stable_path_and_load(value):
    found = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            found.add(module)
            return super().find_class(module, name)

    loaded = Recorder(io.BytesIO(pickle.dumps(value))).load()
    assert {m for m in found if m.startswith("graphamp")} == {"graphamp.runtime"}, found
    assert type(loaded) is type(value)
    if isinstance(value, runtime.InputGuard):
        loaded(torch.ones(2, 3))  # the loaded guard checks as the original
        with pytest.raises(graphamp.errors.InputShapeError):
            loaded(torch.ones(3, 3))
    else:
        assert loaded == value
