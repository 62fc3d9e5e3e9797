"""docs/private-torch-apis.md, the ledger of private torch names graphamp uses, is complete and current.

Every ``.py`` file under ``graphamp/`` is parsed with :mod:`ast` (no text search), and every private
torch name it uses is collected:

* an attribute chain rooted at ``torch`` or at a name bound to a torch path (``import torch._dynamo as
  d``, ``from torch._inductor import config``, ``from torch.utils import _pytree as pytree``, ``aten =
  torch.ops.aten``, or such a name imported from another graphamp module). Bindings are resolved per
  function and class scope, and any other binding of the name in a scope shadows them;
* ``getattr``/``setattr``/``hasattr``/``delattr`` on such a chain with a constant attribute name, a
  ``from torch... import name``, a private keyword argument of a torch function (as
  ``function.keyword``), and a string constant that is exactly a dotted torch path (module names
  looked up in ``sys.modules``, logger names);
* a private attribute read or set on any other object (``m._parameters``, ``op._schema``, also as a
  ``getattr`` constant) whose name graphamp does not define itself (a ``def``, a class or module
  attribute, ``self._x = ...``): such a name comes from outside graphamp, from torch or another
  library. A name graphamp also defines is still torch's when one of the torch objects in
  :func:`torch_attribute_owners` has it and graphamp reads it on an object other than ``self``; a
  string constant that is such a name (``vars(m)["_parameters"]``) counts too.

A name is private when a dotted component starts with ``_`` and is not a dunder. A whole package
(``torch._dynamo``, ``torch._C``) named on its own is not a use: what is used from it is. A row's
entries are the backticked names before its ``: **``, outside the parenthesized list of files. An
entry covers a used name that equals it or lies below it (``torch.utils._pytree`` covers
``torch.utils._pytree.tree_map``), a module that an import names when the entry lies below it, and a
private attribute of another object when the entry ends with it (``torch.nn.Module._parameters``
covers ``m._parameters``). Private attributes of Python and other libraries are in ``NOT_TORCH``.

The section "Global torch state graphamp changes" lists the state graphamp changes for the whole
process. The places that change torch state are found by the same scan: an assignment, ``setattr``,
``delattr`` or ``del`` on a torch path, and a call on a torch path of a mutating method (``insert``,
``pop``, ``update``...), ``patch``, a setter (``set_*``, ``_jit_set_*``), a registration
(``register_*``) or ``torch.library``. Each must be named in that section, unless ``THREAD_LOCAL``
says only the calling thread sees it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "graphamp"
LEDGER = ROOT / "docs" / "private-torch-apis.md"
API_SECTION = "## Private names graphamp uses"
GLOBAL_SECTION = "## Global torch state graphamp changes"
NO_PUBLIC = "**no public API**"
REPLACEMENT = "**public replacement:**"

# Private attributes graphamp uses that are not torch's: the owner, and what graphamp does with it.
NOT_TORCH: dict[str, str] = {
    "_getframe": "Python's sys: backend/observe walks the stack up to the model code's call site.",
    "_fields": "Python's namedtuples: runtime and capture/functions rebuild a namedtuple from its parts.",
    "_SubParsersAction": "Python's argparse: the type of the subcommand table the CLI's add_parser functions take.",
    "_args_from_interpreter_flags": "Python's subprocess: graphamp bench's re-run gets the interpreter's own options (-W, -X, ...), as multiprocessing passes them.",
}

# Torch state that only the calling thread sees: not process-wide, so not rows of the global-state
# section. Matched against the changed path as ledger entries are.
THREAD_LOCAL = {
    "torch._C._set_grad_enabled": "grad mode is thread-local",
    "torch._C._push_on_torch_function_stack": "the torch-function mode stack is thread-local",
    "torch._C._pop_torch_function_stack": "the torch-function mode stack is thread-local",
    "torch._C._functorch._grad_increment_nesting": "functorch's interpreter stack is thread-local",
    "torch._C._functorch._grad_decrement_nesting": "functorch's interpreter stack is thread-local",
    "torch._functorch.predispatch._vmap_increment_nesting": "functorch's interpreter stack is thread-local",
    "torch._functorch.predispatch._vmap_decrement_nesting": "functorch's interpreter stack is thread-local",
    "torch._functorch.predispatch._jvp_increment_nesting": "functorch's interpreter stack is thread-local",
    "torch._functorch.predispatch._jvp_decrement_nesting": "functorch's interpreter stack is thread-local",
    "torch._dynamo.utils._metrics_context_tls": "dynamo's metrics context is a threading.local",
    "torch.set_grad_enabled": "grad mode is thread-local",
    "torch.set_autocast_enabled": "autocast's switches are thread-local",
    "torch.set_autocast_dtype": "autocast's switches are thread-local",
    "torch.set_autocast_cache_enabled": "autocast's switches are thread-local",
}


def is_private(component: str) -> bool:
    return component.startswith("_") and not (component.startswith("__") and component.endswith("__"))


def private_path(path: str) -> bool:
    return any(is_private(c) for c in path.split("."))


_DOTTED_TORCH = re.compile(r"torch(\.[A-Za-z_]\w*)+")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_TORCH_DIR = Path(importlib.util.find_spec("torch").submodule_search_locations[0])


@functools.cache
def is_package(path: str) -> bool:
    """A package (``torch._dynamo``) or ``torch._C``, whose members are unrelated APIs; judged from
    torch's files, without importing it."""
    return _TORCH_DIR.parent.joinpath(*path.split(".")).is_dir()


@functools.cache
def is_module(path: str) -> bool:
    """A package, a ``.py`` module, or one of ``torch._C``'s submodules (``.pyi`` stubs)."""
    base = _TORCH_DIR.parent.joinpath(*path.split("."))
    return base.is_dir() or base.with_suffix(".py").is_file() or base.with_suffix(".pyi").is_file()


@dataclass(frozen=True)
class Use:
    name: str  # a dotted torch path, or ".attr": a private attribute of some other object
    file: str
    line: int
    on_self: bool = False  # an attribute of ``self`` or ``cls``
    module: bool = False  # a module imported or named on its own: an entry below it covers it

    def __str__(self) -> str:
        return f"{self.name} at {self.file}:{self.line}"


# --- the scan ---------------------------------------------------------------------------------------

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_MUTATORS = {
    "patch", "insert", "remove", "pop", "popitem", "update", "clear", "append", "extend", "add",
    "discard", "setdefault", "__setitem__", "__delitem__",
}


def _mutating_call(path: str) -> bool:
    last = path.rsplit(".", 1)[-1]
    return (
        last in _MUTATORS
        or re.match(r"_*(jit_)?set_|register_|py_impl$|impl$|define$|manual_seed$|use_deterministic", last) is not None
        or path.startswith("torch.library.")
    )


def _scope_children(scope: ast.AST) -> tuple[list[ast.AST], list[ast.AST]]:
    """The nodes that belong to ``scope`` itself, and the scopes nested in it. A nested def's
    decorators, defaults and annotations, and a nested class's bases, belong to ``scope``."""
    todo = [scope.body] if isinstance(scope, ast.Lambda) else list(scope.body)
    own, nested = [], []
    while todo:
        node = todo.pop()
        if isinstance(node, _SCOPES):
            nested.append(node)
            todo.extend(getattr(node, "decorator_list", []))
            if isinstance(node, ast.ClassDef):
                todo.extend([*node.bases, *node.keywords])
            else:
                a = node.args
                todo.extend([*a.defaults, *(d for d in a.kw_defaults if d is not None)])
                if not isinstance(node, ast.Lambda):
                    args = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                    todo.extend(x.annotation for x in args if x is not None and x.annotation is not None)
                    todo.extend([node.returns] if node.returns is not None else [])
            continue
        own.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return own, nested


def _chain(node: ast.AST) -> tuple[str, list[str]] | None:
    """``a.b.c`` as ("a", ["b", "c"]); None when it is not rooted at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return (node.id, parts[::-1]) if isinstance(node, ast.Name) else None


def _absolute(module: str | None, level: int, file_module: str, is_init: bool) -> str | None:
    if level == 0:
        return module
    package = file_module.split(".") if is_init else file_module.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, module] if module else base)


class _Project:
    """graphamp's modules and the torch paths each binds at module level, so that a name one module
    imports from another (``from graphamp.verify.signatures import aten``) resolves too."""

    def __init__(self, files: dict[str, ast.Module]):
        self.trees = files  # module name -> tree
        self._exports: dict[str, dict[str, str | None]] = {}

    def is_module(self, name: str) -> bool:
        return name in self.trees

    def exports(self, module: str) -> dict[str, str | None]:
        if module in self._exports:
            return self._exports[module]
        self._exports[module] = {}  # a cycle resolves to nothing
        tree = self.trees[module]
        top = _Scope(None, False, self, module, module.endswith("__init__"))
        nodes, todo = [], list(tree.body)
        while todo:  # module level, including if/try blocks
            node = todo.pop(0)
            if isinstance(node, (ast.If, ast.Try)):
                todo.extend([*node.body, *node.orelse, *getattr(node, "finalbody", [])])
                for h in getattr(node, "handlers", []):
                    todo.extend(h.body)
            else:
                nodes.append(node)
        top.bind(nodes, [])
        self._exports[module] = dict(top.names)
        return self._exports[module]

    def resolve(self, path: str | None, parts: list[str]) -> str | None:
        """The torch path ``path.parts`` names, or None."""
        while path is not None and path.startswith("graphamp") and parts:
            if not self.is_module(path):
                return None
            name, parts = parts[0], parts[1:]
            sub = f"{path}.{name}"
            path = sub if self.is_module(sub) else self.exports(path).get(name)
        if path is None or path.split(".")[0] != "torch":
            return None
        return ".".join([path, *parts])


class _Scope:
    def __init__(self, parent: _Scope | None, is_class: bool, project: _Project, module: str, is_init: bool):
        self.parent, self.is_class, self.project = parent, is_class, project
        self.module, self.is_init = module, is_init
        self.names: dict[str, str | None] = {}  # a torch or graphamp path, or None: something else

    def lookup(self, name: str) -> str | None:
        scope, first = self, True
        while scope is not None:
            if (first or not scope.is_class) and name in scope.names:
                return scope.names[name]
            scope, first = scope.parent, False
        return None

    def resolve(self, node: ast.AST) -> str | None:
        c = _chain(node)
        return None if c is None else self.project.resolve(self.lookup(c[0]), c[1])

    def bind(self, own: list[ast.AST], nested: list[ast.AST]) -> None:
        """Imports bind a path; a plain ``name = <torch chain>`` is an alias; any other binding of a
        name shadows it."""
        other: list[str] = []
        aliases: list[ast.Assign] = []
        for node in own:
            kind = type(node)
            if kind is ast.Name:
                if type(node.ctx) is not ast.Load:
                    other.append(node.id)
            elif kind is ast.Import:
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    known = top in ("torch", "graphamp")
                    if alias.asname:
                        self.names[alias.asname] = alias.name if known else None
                    else:
                        self.names[top] = top if known else None
            elif kind is ast.ImportFrom:
                module = _absolute(node.module, node.level, self.module, self.is_init)
                top = module.split(".")[0] if module else None
                for alias in node.names:
                    target = None
                    if top == "torch":
                        target = f"{module}.{alias.name}"
                    elif top == "graphamp":
                        sub = f"{module}.{alias.name}"
                        target = sub if self.project.is_module(sub) else self.project.resolve(module, [alias.name])
                    self.names[alias.asname or alias.name] = target
            elif kind is ast.Assign:
                if len(node.targets) == 1 and type(node.targets[0]) is ast.Name:
                    aliases.append(node)
            elif kind in (ast.ExceptHandler, ast.MatchAs, ast.MatchStar) and node.name:
                other.append(node.name)
        other += [n.name for n in nested if not isinstance(n, ast.Lambda)]
        for name in other:
            self.names.setdefault(name, None)
        for node in aliases:
            path = self.resolve(node.value)
            if path is not None:
                self.names[node.targets[0].id] = path


@dataclass
class Scan:
    uses: list[Use]  # private torch names, and private attributes of other objects
    defined: set[str]  # private attribute names graphamp defines
    strings: list[Use]  # string constants that are private identifiers (".name")
    mutations: list[Use]  # torch paths graphamp assigns, deletes, or calls a mutating method of


def scan_sources(sources: dict[str, str]) -> Scan:
    """Scan ``{relative file path: source}``; module names come from the paths."""
    trees, files = {}, {}
    for file, source in sources.items():
        module = file[: -len(".py")].replace("/", ".")
        module = module[: -len(".__init__")] if module.endswith(".__init__") else module
        trees[module] = ast.parse(source, file)
        files[module] = file
    project = _Project(trees)
    scan = Scan([], set(), [], [])
    for module, tree in trees.items():
        _scan_module(tree, files[module], module, files[module].endswith("__init__.py"), project, scan)
        if is_private(module.rsplit(".", 1)[-1]):
            scan.defined.add(module.rsplit(".", 1)[-1])
    return scan


def _scan_module(tree: ast.Module, file: str, module: str, is_init: bool, project: _Project, scan: Scan) -> None:
    def add(path: str, node: ast.AST) -> None:
        # A package named on its own is not a use, what is used from it is; a module is one, that an
        # entry for a member of it covers too.
        if private_path(path) and not is_package(path):
            scan.uses.append(Use(path, file, node.lineno, module=is_module(path)))

    def mutate(path: str, node: ast.AST) -> None:
        scan.mutations.append(Use(path, file, node.lineno))

    def visit(scope_node: ast.AST, parent: _Scope | None) -> None:
        scope = _Scope(parent, isinstance(scope_node, ast.ClassDef), project, module, is_init)
        own, nested = _scope_children(scope_node)
        if not isinstance(scope_node, (ast.Module, ast.ClassDef)):
            a = scope_node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None:
                    scope.names[arg.arg] = None
        scope.bind(own, nested)
        inner = {id(n.value) for n in own if isinstance(n, ast.Attribute)}  # not the end of a chain
        for node in own:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    path = scope.names.get(alias.asname or alias.name)
                    if path is not None and path.startswith("torch"):
                        add(path, node)
            elif isinstance(node, ast.Attribute) and id(node) not in inner:
                path = scope.resolve(node)
                if path is not None:
                    add(path, node)
                    if isinstance(node.ctx, (ast.Store, ast.Del)):
                        mutate(path, node)
                    continue
                sub = node  # not a torch chain: each private attribute in it belongs to some object
                while isinstance(sub, ast.Attribute):
                    if is_private(sub.attr):
                        on_self = isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls")
                        scan.uses.append(Use("." + sub.attr, file, sub.lineno, on_self))
                        if on_self and isinstance(sub.ctx, ast.Store):
                            scan.defined.add(sub.attr)
                    sub = sub.value
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and id(node) not in inner:
                path = scope.resolve(node)
                if path is not None and path != "torch":
                    add(path, node)
            elif isinstance(node, ast.Call):
                _call(node, scope, add, mutate)
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                path = scope.resolve(node.value)
                if path is not None:
                    mutate(path, node)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if _DOTTED_TORCH.fullmatch(node.value) and private_path(node.value):
                    scan.uses.append(Use(node.value, file, node.lineno))  # a module name counts here
                elif _IDENT.fullmatch(node.value) and is_private(node.value):
                    scan.strings.append(Use("." + node.value, file, node.lineno))
            # What graphamp defines itself.
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and is_private(node.id):
                if isinstance(scope_node, (ast.Module, ast.ClassDef)):
                    scan.defined.add(node.id)
        for n in nested:
            if not isinstance(n, ast.Lambda) and is_private(n.name):
                scan.defined.add(n.name)
            visit(n, scope)

    def _call(node: ast.Call, scope: _Scope, add, mutate) -> None:
        f = node.func
        path = scope.resolve(f)
        if path is not None and _mutating_call(path):
            mutate(path, node)
        if path is not None:  # a private keyword argument of a torch function, as function.keyword
            for kw in node.keywords:
                if kw.arg is not None and is_private(kw.arg):
                    add(f"{path}.{kw.arg}", node)
        if not (isinstance(f, ast.Name) and f.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2):
            return
        name, base = node.args[1], scope.resolve(node.args[0])
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            if base is not None and f.id in ("setattr", "delattr"):
                mutate(base, node)  # an attribute named at run time
            return
        if base is not None:
            add(f"{base}.{name.value}", node)
            if f.id in ("setattr", "delattr"):
                mutate(f"{base}.{name.value}", node)
        elif is_private(name.value):
            obj = node.args[0]
            on_self = isinstance(obj, ast.Name) and obj.id in ("self", "cls")
            scan.uses.append(Use("." + name.value, file, node.lineno, on_self))
            if on_self and f.id == "setattr":
                scan.defined.add(name.value)

    visit(tree, None)


@functools.cache
def scan_package() -> Scan:
    return scan_sources({str(p.relative_to(ROOT)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))})


@functools.cache
def torch_attribute_owners() -> dict[str, list[str]]:
    """Private attribute names of the torch objects graphamp handles most (modules, tensors, FX
    graphs, op overloads, the grad scaler), with their class: a name graphamp defines as well is
    still torch's when graphamp reads it on one of these."""
    import torch
    import torch.fx

    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    graph.output(node)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    objects = {
        "torch.Tensor": torch.empty(0),
        "torch.nn.Module": torch.nn.Module(),
        "torch.fx.GraphModule": gm,
        "torch.fx.Graph": graph,
        "torch.fx.Node": node,
        "torch.fx.Interpreter": torch.fx.Interpreter(gm),
        "torch._ops.OpOverload": torch.ops.aten.add.Tensor,
        "torch._ops.OpOverloadPacket": torch.ops.aten.add,
        "torch.amp.GradScaler": torch.amp.GradScaler("cpu"),
    }
    owners: dict[str, list[str]] = {}
    for owner, obj in objects.items():
        for name in dir(obj):
            if is_private(name):
                owners.setdefault(name, []).append(owner)
    return owners


def private_uses(scan: Scan) -> list[Use]:
    """The private torch names and the private attributes of torch objects that ``scan`` found."""
    owners = torch_attribute_owners()
    out = []
    for u in scan.uses:
        if u.name.startswith("."):
            attr = u.name[1:]
            if attr in NOT_TORCH:
                continue
            if attr in scan.defined and (u.on_self or attr not in owners):
                continue  # graphamp's own attribute
        out.append(u)
    # A string that is such a name is one too (``vars(m)["_parameters"]``), except a Tensor method:
    # those are ATen ops, whose names fill the policy tables.
    out += [s for s in scan.strings if set(owners.get(s.name[1:], ["torch.Tensor"])) - {"torch.Tensor"}]
    return out


# --- the ledger -------------------------------------------------------------------------------------


@dataclass
class Row:
    text: str
    line: int
    entries: list[str]  # the backticked names before the ":"


def _rows(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """List items, each with its continuation lines joined."""
    rows: list[tuple[int, str]] = []
    for number, line in lines:
        if line.startswith("- "):
            rows.append((number, line[2:].strip()))
        elif rows and line.strip() and not line.startswith("#") and line.startswith(" "):
            rows[-1] = (rows[-1][0], rows[-1][1] + " " + line.strip())
        elif not line.strip() or line.startswith("#") or not line.startswith(" "):
            if rows and rows[-1][0] != -1:
                rows.append((-1, ""))  # a paragraph or heading ends the list
    return [r for r in rows if r[0] != -1]


def _section(lines: list[tuple[int, str]], heading: str) -> list[tuple[int, str]]:
    """The lines under ``heading`` (its ``###`` subsections included), up to the next ``##``."""
    start = next((i for i, (_, line) in enumerate(lines) if line.split(" {#")[0].strip() == heading), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(lines)) if lines[i][1].startswith("## ")), len(lines))
    return lines[start + 1 : end]


def parse_ledger(text: str) -> tuple[list[Row], list[Row]]:
    """The rows of the private-name section, and those of the global-state section."""
    lines = list(enumerate(text.splitlines(), 1))
    api, state = [], []
    for number, row in _rows(_section(lines, API_SECTION)):
        # The entries: the backticked names before ": **", outside the parenthesized "where".
        head = row.split(": **", 1)[0]
        depth, kept = 0, []
        for i, part in enumerate(re.split(r"(`[^`]+`)", head)):
            if i % 2:
                if depth == 0:
                    kept.append(part[1:-1])
                continue
            for ch in part:
                depth += (ch == "(") - (ch == ")")
        api.append(Row(row, number, kept))
    for number, row in _rows(_section(lines, GLOBAL_SECTION)):
        names = [m.group(0) for chunk in re.findall(r"`([^`]+)`", row) for m in _DOTTED_TORCH.finditer(chunk)]
        state.append(Row(row, number, names))
    return api, state


def covers(entry: str, name: str, module: bool = False) -> bool:
    if name.startswith("."):
        return entry.endswith(name)
    return name == entry or name.startswith(entry + ".") or (module and entry.startswith(name + "."))


def unlisted(uses: list[Use], entries: list[str]) -> list[Use]:
    return [u for u in uses if not any(covers(e, u.name, u.module) for e in entries)]


def stale(entries: list[str], uses: list[Use]) -> list[str]:
    return [e for e in entries if not any(covers(e, u.name, u.module) for u in uses)]


def _report(uses: list[Use]) -> str:
    owners = torch_attribute_owners()
    by: dict[str, list[str]] = {}
    for u in uses:
        name = u.name
        if name.startswith(".") and name[1:] in owners:
            name = f"{owners[name[1:]][0]}{name}"
        by.setdefault(name, []).append(f"{u.file}:{u.line}")
    return "\n".join(f"  {n}  ({', '.join(sorted(set(w))[:4])}{', ...' if len(set(w)) > 4 else ''})" for n, w in sorted(by.items()))


@functools.cache
def _ledger() -> tuple[list[Row], list[Row]]:
    return parse_ledger(LEDGER.read_text())


# --- the tests --------------------------------------------------------------------------------------


def test_every_private_torch_name_graphamp_uses_is_in_the_ledger():
    api, _ = _ledger()
    missing = unlisted(private_uses(scan_package()), [e for row in api for e in row.entries])
    assert not missing, (
        f"private torch names used in graphamp/ and not in {LEDGER.relative_to(ROOT)} (add a row: the name, "
        f"why graphamp needs it, and {NO_PUBLIC} or {REPLACEMENT} `...`; an attribute of another object is "
        f"listed as its class's path, a non-torch one in NOT_TORCH):\n" + _report(missing)
    )


def test_every_ledger_entry_is_still_used():
    api, _ = _ledger()
    uses = private_uses(scan_package())
    gone = stale([e for row in api for e in row.entries], uses)
    assert not gone, f"ledger entries graphamp no longer uses (delete them): {gone}"
    unused = [a for a in NOT_TORCH if not any(u.name == "." + a for u in scan_package().uses)]
    assert not unused, f"NOT_TORCH names graphamp no longer uses: {unused}"


def row_problems(rows: list[Row]) -> list[tuple[int, str]]:
    """(line, what is wrong) for each row without entries, with an entry that is not a dotted private
    torch path or is a whole package, without **no public API** or a replacement, or without reason."""
    bad = []
    for row in rows:
        if not row.entries:
            bad.append((row.line, "no backticked name before ': **'"))
        for e in row.entries:
            if not (_DOTTED_TORCH.fullmatch(e) and private_path(e)):
                bad.append((row.line, f"`{e}` is not a dotted private torch path"))
            elif is_package(e):
                bad.append((row.line, f"`{e}` is a whole package: list what is used from it"))
        if NO_PUBLIC in row.text:
            reason = row.text.split(NO_PUBLIC, 1)[1]
        elif REPLACEMENT in row.text:
            reason = row.text.split(REPLACEMENT, 1)[1]
            if not re.match(r"\s*`[^`]+`", reason):
                bad.append((row.line, f"{REPLACEMENT} is not followed by the replacement in backticks"))
            reason = re.sub(r"^\s*`[^`]+`", "", reason)
        else:
            bad.append((row.line, f"neither {NO_PUBLIC} nor {REPLACEMENT}"))
            continue
        if len(re.findall(r"[A-Za-z]{2,}", reason)) < 6:
            bad.append((row.line, "no reason given"))
    return bad


def test_every_ledger_row_has_a_reason_and_says_what_replaces_it():
    api, _ = _ledger()
    assert len(api) > 20
    bad = row_problems(api)
    assert not bad, "\n".join(f"docs/private-torch-apis.md:{n}: {why}" for n, why in bad)


def test_every_change_to_global_torch_state_is_in_the_ledger():
    _, state = _ledger()
    named = [n for row in state for n in row.entries]
    sites = [m for m in scan_package().mutations if not any(covers(t, m.name) for t in THREAD_LOCAL)]
    missing = [m for m in sites if not any(covers(n, m.name) for n in named)]
    assert not missing, (
        f"changes to torch state not listed in the ledger's '{GLOBAL_SECTION[3:]}' section (add a row: what, "
        "where, how it is scoped and restored; or THREAD_LOCAL in this test if only the thread sees it):\n"
        + "\n".join(f"  {m}" for m in missing)
    )
    for row in state:
        assert re.search(r"\b(restor|remov|scop|releas|only|while|inside|under|never)", row.text), row.text


SNIPPET = '''
import torch
import torch._dynamo as dyn
from torch._inductor import config
from torch.utils import _pytree as pytree
from torch import _C
from torch.fx.experimental.proxy_tensor import make_fx

aten = torch.ops.aten
_LOGGER = "torch._subclasses.fake_tensor"


class Mine:
    def __init__(self):
        self._cache = {}

    def f(self, module, op):
        config.freezing = True
        dyn.config.patch(recompile_limit=2)
        pytree.tree_map(abs, [1])
        _C._dispatch_dump("aten::add")
        module._parameters
        op._schema
        self._cache.clear()  # graphamp's own attribute
        aten._to_copy.default
        getattr(torch.compiler, "_is_exporting_flag")
        make_fx(abs, _error_on_data_dependent_ops=False)
        torch.__version__


def g(config):
    config.freezing  # a parameter: not torch's config
'''

OTHER = '''
from graphamp.snippet import aten


def h(t):
    return aten._unsafe_view.default(t, [1])
'''


def test_the_scan_finds_an_unlisted_name_a_stale_row_and_a_row_without_reason():
    scan = scan_sources({"graphamp/snippet.py": SNIPPET, "graphamp/other.py": OTHER})
    found = {u.name for u in private_uses(scan)}
    assert found == {
        "torch._inductor.config", "torch._inductor.config.freezing", "torch._dynamo.config.patch",
        "torch.utils._pytree", "torch.utils._pytree.tree_map", "torch._C._dispatch_dump", "._parameters",
        "._schema", "torch.ops.aten._to_copy.default", "torch.compiler._is_exporting_flag",
        "torch.fx.experimental.proxy_tensor.make_fx._error_on_data_dependent_ops",
        "torch._subclasses.fake_tensor", "torch.ops.aten._unsafe_view.default",
    }, found
    ledger = '''# Ledger

- `torch._C._dispatch_dump` (x): **no public API**. Not under the section's heading, so no entry.

## Private names graphamp uses

- `torch._inductor.config` (`patch(freezing=True)`, x): **no public API**. The freezing flag has no public switch.
- `torch.utils._pytree`, `torch.nn.Module._parameters` (x): **no public API**. A reason that is long enough here.
- `torch._subclasses.fake_tensor`, `torch.ops.aten._unsafe_view` (x): **no public API**. Another reason, long enough for the check.
- `torch.fx.experimental.proxy_tensor.make_fx._error_on_data_dependent_ops` (x): **public replacement:** `make_fx`.
- `torch._C._unused_thing` (x): a row for a name nothing uses any more, and without a marker.

## Global torch state graphamp changes

- `torch._inductor.config` patched only while compiling.
'''
    api, state = parse_ledger(ledger)
    entries = [e for row in api for e in row.entries]
    assert "patch(freezing=True)" not in entries
    missing = {u.name for u in unlisted(private_uses(scan), entries)}
    assert missing == {
        "torch._dynamo.config.patch", "torch._C._dispatch_dump", "._schema", "torch.ops.aten._to_copy.default",
        "torch.compiler._is_exporting_flag",
    }, missing
    assert stale(entries, private_uses(scan)) == ["torch._C._unused_thing"]
    assert [why for _, why in row_problems(api)] == ["no reason given", f"neither {NO_PUBLIC} nor {REPLACEMENT}"]
    sites = {m.name for m in scan.mutations}
    assert sites == {"torch._inductor.config.freezing", "torch._dynamo.config.patch"}, sites
    named = [n for row in state for n in row.entries]
    assert [m for m in sites if not any(covers(n, m) for n in named)] == ["torch._dynamo.config.patch"]
