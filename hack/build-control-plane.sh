#!/usr/bin/env bash
# Builds the local control plane's binaries from the Go module proxy into a cache folder
# named by every version, so a second run (or a fresh clone on the same machine) skips the build.
# Prints the folder on its last line. See docs/development.md for why each step exists.
# `kueue` builds Kueue (only the e2e tests run it) into a folder of its own with its CRDs and webhook
# manifests, and prints that folder instead.
set -euo pipefail

K8S=${SFTJOB_K8S_VERSION:-1.36.3}
STG=0.${K8S#1.}
ETCD=${SFTJOB_ETCD_VERSION:-3.6.14}
KWOK=${SFTJOB_KWOK_VERSION:-0.8.0}
HELM=${SFTJOB_HELM_VERSION:-3.21.4}
KUEUE=${SFTJOB_KUEUE_VERSION:-0.17.0}
CACHE="${SFTJOB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sftjob}/bin"
KUEUE_DIR="$CACHE/kueue-v$KUEUE"
BIN="$CACHE/k8s-v$K8S-etcd-v$ETCD-kwok-v$KWOK-helm-v$HELM"
TOOLS=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm)

have() { [ -x "$BIN/$1" ]; }
all_built() { for t in "${TOOLS[@]}"; do have "$t" || return 1; done; }

kueue_built() { [ -x "$KUEUE_DIR/kueue" ] && [ -f "$KUEUE_DIR/webhooks.yaml" ]; }
need_go() {
  command -v go >/dev/null || { echo "error: the Go toolchain (go) is not on PATH; install Go >= 1.26 to build the control plane" >&2; exit 3; }
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false"
}
step() { echo "==> [$(date +%H:%M:%S)] $*" >&2; }

case "${1:-}" in
  "") ;;
  --print-dir) echo "$BIN"; exit 0 ;;
  --print-kueue-dir) echo "$KUEUE_DIR"; exit 0 ;;
  kueue)
    if ! kueue_built; then
      need_go
      step "building kueue v$KUEUE"
      mkdir -p "$KUEUE_DIR/crds"
      (cd "$KUEUE_DIR" && GOBIN="$KUEUE_DIR" go install -ldflags "-s -w" "sigs.k8s.io/kueue/cmd/kueue@v$KUEUE" >&2)
      SRC=$(cd "$KUEUE_DIR" && go mod download -json "sigs.k8s.io/kueue@v$KUEUE" | sed -n 's/.*"Dir": "\([^"]*\)".*/\1/p')
      cp "$SRC"/config/components/crd/bases/*.yaml "$KUEUE_DIR/crds/"
      cp "$SRC/config/components/webhook/manifests.yaml" "$KUEUE_DIR/webhooks.yaml.tmp"
      chmod -R u+w "$KUEUE_DIR" && mv "$KUEUE_DIR/webhooks.yaml.tmp" "$KUEUE_DIR/webhooks.yaml"
    fi
    echo "$KUEUE_DIR"; exit 0 ;;
  *) echo "usage: $0 [--print-dir | --print-kueue-dir | kueue]" >&2; exit 2 ;;
esac
if all_built; then echo "$BIN"; exit 0; fi

need_go
mkdir -p "$BIN"

if ! have etcd; then
  step "building etcd v$ETCD"
  d=$(mktemp -d); (cd "$d" && go mod init local.test/etcd-testbin >/dev/null 2>&1 \
    && go get -tool "go.etcd.io/etcd/server/v3@v$ETCD" >&2 \
    && go build -ldflags "-s -w" -o "$BIN/etcd.tmp" go.etcd.io/etcd/server/v3 >&2) \
    && mv "$BIN/etcd.tmp" "$BIN/etcd"; rm -rf "$d"
fi

k8s_missing=0
for t in kube-apiserver kube-controller-manager kube-scheduler kubectl; do have "$t" || k8s_missing=1; done
if [ "$k8s_missing" = 1 ]; then
  step "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl v$K8S (slow the first time)"
  d=$(mktemp -d)
  (
    cd "$d"
    go mod init local.test/k8s-testbin >/dev/null 2>&1
    KMOD=$(go mod download -json "k8s.io/kubernetes@v$K8S" | sed -n 's/.*"GoMod": "\([^"]*\)".*/\1/p')
    go mod edit -go="$(sed -n 's/^go //p' "$KMOD")"
    awk '/^godebug \(/{b=1} b{print} b&&/^\)/{b=0} /^godebug [^(]/{print}' "$KMOD" >> go.mod
    sed -n 's|^[[:space:]]*\(k8s\.io/[a-z0-9.-]*\) => \./staging/.*|\1|p' "$KMOD" |
      while read -r m; do go mod edit -replace="$m=$m@v$STG"; done
    go get -tool "k8s.io/kubernetes/cmd/kube-apiserver@v$K8S" "k8s.io/kubernetes/cmd/kube-controller-manager@v$K8S" \
      "k8s.io/kubernetes/cmd/kube-scheduler@v$K8S" "k8s.io/kubernetes/cmd/kubectl@v$K8S" >&2
    MIN=$(echo "$K8S" | cut -d. -f2); LD="-s -w"
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      LD="$LD -X $p.gitVersion=v$K8S -X $p.gitMajor=1 -X $p.gitMinor=$MIN -X $p.gitTreeState=clean -X $p.buildDate=2026-01-01T00:00:00Z"
    done
    mkdir -p out
    go build -ldflags "$LD" -o out/ k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl >&2
    mv out/* "$BIN/"
  )
  rm -rf "$d"
fi

if ! have kwok; then
  step "building kwok v$KWOK"
  GOBIN="$BIN" go install -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@v$KWOK" >&2
fi

if ! have helm; then
  step "building helm v$HELM"
  GOBIN="$BIN" go install -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM" "helm.sh/helm/v3/cmd/helm@v$HELM" >&2
fi

for t in "${TOOLS[@]}"; do have "$t" || { echo "error: $t was not built into $BIN" >&2; exit 1; }; done
step "all binaries are in $BIN"
echo "$BIN"
