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

# The optional TorchRec baseline, where asked for (see requirements-torchrec.txt).
trstamp=.venv/.gradfabric-torchrec
if [ "${GRADFABRIC_TORCHREC:-0}" = 1 ] && { [ ! -f "$trstamp" ] || [ requirements-torchrec.txt -nt "$trstamp" ]; }; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    -r requirements-torchrec.txt
  touch "$trstamp"
fi

# The simulator's hot path compiled with mypyc (C extensions beside the
# sources); skipped when up to date, and where there is no C compiler the
# pure-Python modules run. GRADFABRIC_PURE=1 skips it.
.venv/bin/python scripts/compile.py

# The emulator's kernel-loss links drop packets with nftables (this kernel's tc
# has no netem and no gact). Installed where we are root on a Debian-like host;
# elsewhere the tests that need it skip and say why.
if ! command -v nft >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "bootstrap: installing nftables (kernel packet loss for the namespace tests)" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables; } >/dev/null 2>&1 \
    || echo "bootstrap: could not install nftables; the kernel-loss test will skip" >&2
fi
