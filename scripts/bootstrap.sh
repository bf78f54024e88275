#!/usr/bin/env bash
# Create .venv (if missing) and install gradfabric with pinned dependencies.
# Idempotent: a second run only checks that everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "gradfabric needs Python >= 3.11 (found $("$PY" --version))" >&2; exit 2; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.gradfabric-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements.lock -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -c requirements.lock -e '.[dev]'
  touch "$stamp"
fi
