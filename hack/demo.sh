#!/usr/bin/env bash
# The main-job command: the local cluster (built the first time), the operator installed with its Helm
# chart, the examples plus a tiny job trained for real on the CPU, shown moving.
#   hack/demo.sh          bring everything up and watch the jobs (the cluster keeps running)
#   hack/demo.sh down     stop the trainer runner, the operator and the cluster
# Extra arguments go to `python -m sftjob_dev.demo` (e.g. --workdir DIR, --watch-seconds 60).
set -euo pipefail
cd "$(dirname "$0")/.."
source hack/lib.sh

command=up
case "${1:-}" in
  up | down) command=$1; shift ;;
  -h | --help) exec sed -n '2,6p' "$0" ;;
esac
if [ "$command" = up ]; then
  install_openssl
  install_python_deps
fi
exec .venv/bin/python -m sftjob_dev.demo "$command" "$@"
