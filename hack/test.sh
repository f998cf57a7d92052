#!/usr/bin/env bash
# The test command: installs everything the tests need on a fresh machine, then runs the whole suite
# (lint, type check, unit tests, trainer tests on the CPU, e2e tests on the real local control plane).
# Re-runs reuse the virtual environment, the Go-built binaries and the Debian packages.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "==> [$(date +%H:%M:%S)] $*"; }

PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "error: Python >= 3.11 is required" >&2; exit 2; }

if [ ! -x .venv/bin/python ]; then
  step "creating .venv"
  "$PY" -m venv .venv
fi
if [ ! -x .venv/bin/uv ]; then
  .venv/bin/pip install --quiet --disable-pip-version-check uv==0.13.8
fi
step "installing Python dependencies (torch is several GB the first time)"
.venv/bin/uv pip install --quiet --python .venv/bin/python -e '.[trainer,dev]'

step "building the control plane (cached by version after the first build)"
hack/build-control-plane.sh >/dev/null

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  step "installing prometheus (Debian package)"
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >/dev/null \
    || { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >/dev/null; }
fi

step "ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
step "mypy"
.venv/bin/mypy
step "pytest (unit, trainer, e2e)"
.venv/bin/python -m pytest "$@"
