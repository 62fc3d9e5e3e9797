"""The documentation: generated pages up to date, the site builds strictly, every code block a page
shows as runnable is run, and no lab-notebook history in user documentation.

The ``>>>`` examples of README.md and docs/*.md run as doctests (scripts/test passes them with
``--doctest-glob='*.md'``); the ```` ```python ```` blocks that are scripts, not doctests, run here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
USER_DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


def _measurements():
    name = "graphamp_docs_measurements"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "measurements.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_measurements_page_is_generated_and_up_to_date(tmp_path):
    """docs/measurements.md is benchmarks/measurements.py's output, never edited by hand; README's
    speed table is its too. Regenerate both into a temp dir and compare."""
    m = _measurements()
    page, readme = tmp_path / "measurements.md", tmp_path / "README.md"
    page.write_text(m.measurements_md())
    readme.write_text(m.readme_with_speed_table((ROOT / "README.md").read_text()))
    hint = "out of date: run `.venv/bin/python benchmarks/measurements.py` and commit the result"
    assert (DOCS / "measurements.md").read_text() == page.read_text(), f"docs/measurements.md is {hint}"
    assert (ROOT / "README.md").read_text() == readme.read_text(), f"README.md's speed table is {hint}"


def test_cited_results_files_exist_and_are_linked():
    """Every results file the page cites exists, and every section the guides link to exists."""
    m = _measurements()
    for c in m.CITED:
        assert (m.RESULTS / c.file).is_file(), c.file
    anchors = m.anchors()
    assert m.anchor(m.SPEED_BY_CLASS) in anchors
    for doc in USER_DOCS:
        for anchor in re.findall(r"measurements\.md#([\w-]+)", doc.read_text()):
            assert anchor in anchors, f"{doc.name} links to measurements.md#{anchor}, which the page does not have"


def _between(text: str, begin: str, end: str) -> str:
    start = text.index(begin)
    stop = text.find(end, start + len(begin))
    return text[start:stop if stop >= 0 else len(text)]


def test_readme_has_one_speed_table_and_the_docs_one_per_cpu_class():
    """README's generated region holds one table (README_CLASS's) and links to the section of
    docs/measurements.md that holds every CPU class's table, README's included."""
    m = _measurements()
    header = "| model | task |"
    region = _between((ROOT / "README.md").read_text(), m.SPEED_BEGIN, m.SPEED_END)
    assert region.count(header) == 1, "README's speed-table region must hold exactly one table"
    assert f"docs/measurements.md#{m.anchor(m.SPEED_BY_CLASS)}" in region
    assert m.README_CLASS in m.SPEED_FILES
    section = _between((DOCS / "measurements.md").read_text(), f"\n## {m.SPEED_BY_CLASS}\n", "\n## ")
    assert section.count(header) == len(m.SPEED_FILES), "docs/measurements.md needs one speed table per CPU class"
    readme_rows = [line for line in region.splitlines() if line.startswith("| ")]
    assert all(line in section.splitlines() for line in readme_rows), "README's table must be one of the docs' tables"


def _script_blocks() -> list[tuple[str, str]]:
    blocks = []
    for doc in USER_DOCS:
        for i, m in enumerate(FENCE.finditer(doc.read_text())):
            lang, body = m.group(1), m.group(2)
            if lang == "python" and not body.lstrip().startswith(">>>"):
                blocks.append((f"{doc.name}[{i}]", body))
    return blocks


def test_every_code_block_is_run_or_marked_not_runnable():
    """A ```python block is either a doctest (run by pytest's doctest glob) or a script (run below);
    anything else is marked bash or text, so no block looks runnable without being run."""
    for doc in USER_DOCS:
        for m in FENCE.finditer(doc.read_text()):
            lang = m.group(1)
            assert lang in ("python", "bash", "text"), f"{doc.name}: a ```{lang or '(no language)'} block; use python, bash or text"
    args = (ROOT / "scripts" / "test").read_text()
    assert "--doctest-glob='*.md'" in args and " docs " in args, "scripts/test must run the docs' doctests"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name,code", _script_blocks(), ids=[n for n, _ in _script_blocks()])
def test_script_blocks_run(name, code, tmp_path):
    """Script blocks (FSDP2's example needs a process group of its own) run in a fresh process."""
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{name} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"


HISTORY = re.compile(
    r"\bstops? \d+|\d{1,2}:\d{2} UTC|\(issue \d+\)|\bissue \d+|\bCI time|\bthis session|\bsession \d+"
    r"|\b[Uu]ntil 20\d\d|\b[Ss]ince 20\d\d|\b[Bb]efore 20\d\d-"
)


def test_user_documentation_has_no_lab_notebook_history():
    """User documentation states facts: no CI times, session or stop numbers, tracker numbers,
    times of day, or "until/since <date>" lines (the changelog says what changed)."""
    found = [f"{doc.name}:{n}: {line.strip()[:100]}" for doc in USER_DOCS
             for n, line in enumerate(doc.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not found, "\n".join(found)


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_mkdocs_build_strict(tmp_path):
    """The site builds with --strict: a broken link, anchor or API reference fails."""
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[docs]'), so the site cannot be built here")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    assert (tmp_path / "site" / "api" / "index.html").is_file()
