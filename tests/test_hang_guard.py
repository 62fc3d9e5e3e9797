"""The suite's guard against hangs: a test that never ends fails with the stacks printed."""

import subprocess
import sys
import textwrap
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_a_hanging_test_fails_with_its_stack(tmp_path):
    (tmp_path / "test_hangs.py").write_text(textwrap.dedent('''
        import threading

        def test_waits_for_ever():
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()  # the same thread, a non-reentrant lock: never returns
    '''))
    # The suite's own settings (pyproject.toml: the method, thread), with a limit of 3 s.
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(PYPROJECT), "--rootdir", str(tmp_path),
            "-o", "timeout=3", str(tmp_path / "test_hangs.py"),
        ],
        capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "Timeout" in out and "test_waits_for_ever" in out and "lock.acquire()" in out
