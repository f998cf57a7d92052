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

# A binary only ever appears under its name by a rename from a staging folder beside it (start_build),
# so one that is there is complete.
have() { [ -x "$BIN/$1" ]; }
all_built() { for t in "${TOOLS[@]}"; do have "$t" || return 1; done; }

kueue_built() { [ -x "$KUEUE_DIR/kueue" ] && [ -f "$KUEUE_DIR/webhooks.yaml" ]; }
need_go() {
  command -v go >/dev/null || { echo "error: the Go toolchain (go) is not on PATH; install Go >= 1.26 to build the control plane" >&2; exit 3; }
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false"
}
DOING=
step() { DOING=$*; echo "==> [$(date +%H:%M:%S)] $*" >&2; }

WORK= STAGE=
finish() {
  local rc=$?
  rm -rf ${WORK:+"$WORK"} ${STAGE:+"$STAGE"}
  if [ "$rc" != 0 ] && [ -n "$DOING" ]; then
    echo "error: $DOING failed (exit $rc; the output above says why). Binaries already built are kept: run the same command again to build the rest." >&2
  fi
}
trap finish EXIT

# start_build DIR: throwaway Go modules in a temporary folder, and a staging folder inside DIR that the
# binaries are built into. Renaming one from there to its name is atomic (one file system), so an
# interrupted build or copy never leaves a truncated binary that have() would take as built.
start_build() {
  need_go
  mkdir -p "$1"
  WORK=$(mktemp -d)
  STAGE=$(mktemp -d "$1/.building.XXXXXX")
}
place() { mv -f "$STAGE/$1" "$2/$1"; }

# retry COMMAND...: a Go module download, tried 3 times 20 s apart so that one transient error of the
# module proxy does not fail a run (builds are not retried: they would fail the same way again).
retry() {
  local try
  for try in 1 2 3; do
    "$@" && return 0
    [ "$try" = 3 ] || { echo "warning: '$*' failed (try $try of 3); trying again in 20 s" >&2; sleep 20; }
  done
  echo "error: '$*' failed 3 times; check the network and GOPROXY ($(go env GOPROXY))" >&2
  return 1
}

# go_module NAME: makes a throwaway module to build NAME in and changes into it (call it in a subshell).
go_module() { mkdir "$WORK/$1" && cd "$WORK/$1" && go mod init "local.test/$1-testbin" >/dev/null 2>&1; }

# build_command NAME PACKAGE VERSION LDFLAGS: one command's binary, into the staging folder as NAME.
build_command() {
  (
    go_module "$1"
    retry go get -tool "$2@v$3" >&2
    go build -ldflags "$4" -o "$STAGE/$1" "$2" >&2
  )
}

case "${1:-}" in
  "") ;;
  --print-dir) echo "$BIN"; exit 0 ;;
  --print-kueue-dir) echo "$KUEUE_DIR"; exit 0 ;;
  kueue)
    if ! kueue_built; then
      start_build "$KUEUE_DIR"
      step "building kueue v$KUEUE"
      build_command kueue sigs.k8s.io/kueue/cmd/kueue "$KUEUE" "-s -w"
      SRC=$(cd "$WORK/kueue" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)
      mkdir -p "$KUEUE_DIR/crds"
      cp "$SRC"/config/components/crd/bases/*.yaml "$KUEUE_DIR/crds/"
      cp "$SRC/config/components/webhook/manifests.yaml" "$STAGE/webhooks.yaml"
      chmod -R u+w "$KUEUE_DIR"
      place kueue "$KUEUE_DIR"
      place webhooks.yaml "$KUEUE_DIR"  # last: kueue_built needs it
      DOING=
    fi
    echo "$KUEUE_DIR"; exit 0 ;;
  *) echo "usage: $0 [--print-dir | --print-kueue-dir | kueue]" >&2; exit 2 ;;
esac
if all_built; then echo "$BIN"; exit 0; fi

start_build "$BIN"

if ! have etcd; then
  step "building etcd v$ETCD"
  build_command etcd go.etcd.io/etcd/server/v3 "$ETCD" "-s -w"
  place etcd "$BIN"
fi

K8S_TOOLS=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
k8s_missing=0
for t in "${K8S_TOOLS[@]}"; do have "$t" || k8s_missing=1; done
if [ "$k8s_missing" = 1 ]; then
  step "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl v$K8S (slow the first time)"
  (
    go_module k8s
    retry go mod download "k8s.io/kubernetes@v$K8S" >&2
    KMOD=$(go mod download -json "k8s.io/kubernetes@v$K8S" | sed -n 's/.*"GoMod": "\([^"]*\)".*/\1/p')
    go mod edit -go="$(sed -n 's/^go //p' "$KMOD")"
    awk '/^godebug \(/{b=1} b{print} b&&/^\)/{b=0} /^godebug [^(]/{print}' "$KMOD" >> go.mod
    sed -n 's|^[[:space:]]*\(k8s\.io/[a-z0-9.-]*\) => \./staging/.*|\1|p' "$KMOD" |
      while read -r m; do go mod edit -replace="$m=$m@v$STG"; done
    retry go get -tool "k8s.io/kubernetes/cmd/kube-apiserver@v$K8S" "k8s.io/kubernetes/cmd/kube-controller-manager@v$K8S" \
      "k8s.io/kubernetes/cmd/kube-scheduler@v$K8S" "k8s.io/kubernetes/cmd/kubectl@v$K8S" >&2
    MIN=$(echo "$K8S" | cut -d. -f2); LD="-s -w"
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      LD="$LD -X $p.gitVersion=v$K8S -X $p.gitMajor=1 -X $p.gitMinor=$MIN -X $p.gitTreeState=clean -X $p.buildDate=2026-01-01T00:00:00Z"
    done
    go build -ldflags "$LD" -o "$STAGE/" "${K8S_TOOLS[@]/#/k8s.io/kubernetes/cmd/}" >&2
  )
  for t in "${K8S_TOOLS[@]}"; do place "$t" "$BIN"; done
fi

if ! have kwok; then
  step "building kwok v$KWOK"
  build_command kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK" "-s -w"
  place kwok "$BIN"
fi

if ! have helm; then
  step "building helm v$HELM"
  build_command helm helm.sh/helm/v3/cmd/helm "$HELM" "-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM"
  place helm "$BIN"
fi
DOING=

for t in "${TOOLS[@]}"; do have "$t" || { echo "error: $t was not built into $BIN" >&2; exit 1; }; done
step "all binaries are in $BIN"
echo "$BIN"
