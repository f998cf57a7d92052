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

# prometheus and promtool from the Debian package (the metrics tests run their own Prometheus on a free
# port). Installing it would also start its system service on :9090 and enable it at boot: a policy-rc.d
# keeps it from starting during the install, and where systemd runs it is left disabled and stopped.
# openssl makes the local control plane's certificates (hack/sftjob_dev/pki.py); a slim image lacks it.
install_openssl() {
  if command -v openssl >/dev/null; then return; fi
  step "installing openssl (Debian package, system-wide)"
  local sudo=
  [ "$(id -u)" = 0 ] || sudo=sudo
  local apt=($sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=120)
  "${apt[@]}" install -y --no-install-recommends openssl >/dev/null \
    || { "${apt[@]}" update -qq && "${apt[@]}" install -y --no-install-recommends openssl >/dev/null; }
}

install_prometheus() {
  if command -v prometheus >/dev/null && command -v promtool >/dev/null; then return; fi
  step "installing prometheus (Debian package, system-wide; its service is left stopped and disabled)"
  local sudo=
  [ "$(id -u)" = 0 ] || sudo=sudo
  local apt=($sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=120)
  local policy=/usr/sbin/policy-rc.d ours=
  if [ ! -e "$policy" ]; then  # exit 101: no service may start (removed again below, or on exit)
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
    $sudo chmod 755 "$policy"
    ours=1
    trap "$sudo rm -f $policy" EXIT
  fi
  "${apt[@]}" install -y --no-install-recommends prometheus >/dev/null \
    || { "${apt[@]}" update -qq && "${apt[@]}" install -y --no-install-recommends prometheus >/dev/null; }
  if [ -n "$ours" ]; then
    $sudo rm -f "$policy"
    trap - EXIT
  fi
  if [ -d /run/systemd/system ]; then
    $sudo systemctl disable --now prometheus.service >/dev/null 2>&1 \
      || echo "warning: could not disable prometheus.service; '${sudo:+sudo }systemctl disable --now prometheus' does" >&2
  fi
}
