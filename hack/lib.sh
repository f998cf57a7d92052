# Shared install steps of the two README commands (hack/test.sh and hack/demo.sh); source it from the
# repository root. Each step is idempotent: re-runs reuse the virtual environment, the Go-built
# binaries and the Debian packages.

step() { echo "==> [$(date +%H:%M:%S)] $*"; }

# .venv with the project installed editable, with the trainer's and the developer tools' extras.
install_python_deps() {
  local py=${PYTHON:-python3}
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "error: Python >= 3.11 is required" >&2; exit 2; }
  if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then  # absent, or left half-made by a failed run
    step "creating .venv"
    rm -rf .venv
    "$py" -m venv .venv || {
      echo "error: '$py -m venv' failed; on Debian/Ubuntu install python3-venv (apt-get install python3-venv)" >&2
      rm -rf .venv
      exit 2
    }
  fi
  if [ ! -x .venv/bin/uv ]; then
    .venv/bin/pip install --quiet --disable-pip-version-check uv==0.13.8
  fi
  step "installing Python dependencies (torch is several GB the first time)"
  .venv/bin/uv pip install --quiet --python .venv/bin/python -e '.[trainer,dev]'
}

# etcd, the Kubernetes components, KWOK and helm, built once from their Go modules.
build_control_plane() {
  step "building the control plane (cached by version after the first build)"
  hack/build-control-plane.sh >/dev/null
}

# Kueue's manager, CRDs and webhook manifests, for the e2e tests that queue jobs under the real thing.
build_kueue() {
  step "building Kueue (cached by version after the first build)"
  hack/build-control-plane.sh kueue >/dev/null
}

# prometheus and promtool from the Debian package (the metrics tests run a real Prometheus).
install_prometheus() {
  if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
    step "installing prometheus (Debian package)"
    local sudo=
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >/dev/null \
      || { $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >/dev/null; }
  fi
}
