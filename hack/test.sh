#!/usr/bin/env bash
# The test command: installs everything the tests need on a fresh machine, then runs the whole suite
# (lint, type check, unit tests, trainer tests on the CPU, e2e tests on the real local control plane).
# Re-runs reuse the virtual environment, the Go-built binaries and the Debian packages.
set -euo pipefail
cd "$(dirname "$0")/.."
source hack/lib.sh

install_openssl
install_python_deps
build_control_plane
build_kueue
install_prometheus

step "ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
step "mypy"
.venv/bin/mypy
step "pytest (unit, trainer, e2e)"
.venv/bin/python -m pytest "$@"
