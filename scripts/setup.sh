#!/usr/bin/env bash
# Set up .venv with graphamp on a fresh machine; idempotent, so both README commands call it.
#   scripts/setup.sh [EXTRAS]     e.g. scripts/setup.sh test
#   scripts/setup.sh --torch-only the venv and torch alone (scripts/test then installs the rest and
#                                 the census site side by side)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-}"
# The interpreter: $PYTHON, else the distribution's Python 3.11 where it can make a venv, else python3.
# The torch wheel on disk is for 3.11; the distribution's build (Debian's here) ran the test suite
# about 18% faster than this machine's pyenv build (no PGO/LTO, a shared libpython), and graphamp's
# capture is mostly Python.
if [ ! -x "$root/.venv/bin/python" ]; then
  if [ -n "${PYTHON:-}" ]; then
    "$PYTHON" -m venv "$root/.venv"
  elif ! { [ -x /usr/bin/python3.11 ] && /usr/bin/python3.11 -m venv "$root/.venv" 2>/dev/null; }; then
    rm -rf "$root/.venv"
    python3 -m venv "$root/.venv"
  fi
fi
vpy="$root/.venv/bin/python"
# A CPU wheel of torch 2.13.0 lies on disk; a bare `pip install torch` would pull a multi-GB CUDA build.
# --no-compile: pip would byte-compile every module of torch and transformers (about 30 s of a clean
# set-up); the README commands instead let Python compile, once, only what is imported (they unset
# PYTHONDONTWRITEBYTECODE for that).
if ! "$vpy" -c "import torch" 2>/dev/null; then
  "$vpy" -m pip install -q --no-compile --disable-pip-version-check torch==2.13.0
fi
[ "$extras" = "--torch-only" ] && exit 0
stamp="$root/.venv/.graphamp-${extras:-base}-$(cat "$root/pyproject.toml" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  "$vpy" -m pip install -q --no-compile --disable-pip-version-check -e "$root${extras:+[$extras]}"
  touch "$stamp"
fi
