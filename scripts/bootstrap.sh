#!/usr/bin/env bash
# Create .venv (if missing) and install gradfabric with pinned dependencies.
# Idempotent: a second run only checks that everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "gradfabric needs Python >= 3.11 (found $("$PY" --version))" >&2; exit 2; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# Installed again whenever what the build reads changed: the dependency pins,
# setup.py, the native sources and the modules compiled with mypyc. pip
# compiles the native code (setup.py); a build that fails fails this script.
stamp=.venv/.gradfabric-installed
inputs=$(.venv/bin/python - <<'PY'
import hashlib, importlib.util, pathlib
spec = importlib.util.spec_from_file_location("b", "src/gradfabric/_build.py")
b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)
pkg = pathlib.Path("src/gradfabric")
files = [pathlib.Path(f) for f in ("setup.py", "pyproject.toml", "requirements.lock")]
files += sorted(pkg.rglob("*.c")) + sorted(pkg.rglob("*.h")) + [pkg / "_build.py"]
files += [pkg.joinpath(*m.split(".")).with_suffix(".py") for m in b.HOT]
h = hashlib.sha256()
for f in files:
    h.update(str(f).encode() + b"\0" + f.read_bytes())
print(h.hexdigest(), "pure" if __import__("os").environ.get("GRADFABRIC_PURE") else "native")
PY
)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$inputs" ]; then
  rm -f "$stamp"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -c requirements.lock -e '.[dev]'
  echo "$inputs" > "$stamp"
fi

# The optional TorchRec baseline, where asked for (see requirements-torchrec.txt).
trstamp=.venv/.gradfabric-torchrec
if [ "${GRADFABRIC_TORCHREC:-0}" = 1 ] && { [ ! -f "$trstamp" ] || [ requirements-torchrec.txt -nt "$trstamp" ]; }; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    -r requirements-torchrec.txt
  touch "$trstamp"
fi

# The DDP hooks' C++ extension, against the torch just installed (fails where
# a compiler is present and the build fails).
.venv/bin/python scripts/compile.py

# The emulator's kernel-loss links drop packets with nftables (this kernel's tc
# has no netem and no gact). Installed where we are root on a Debian-like host;
# elsewhere the tests that need it skip and say why.
if ! command -v nft >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "bootstrap: installing nftables (kernel packet loss for the namespace tests)" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables; } >/dev/null 2>&1 \
    || echo "bootstrap: could not install nftables; the kernel-loss test will skip" >&2
fi
