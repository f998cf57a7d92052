"""Finding (and on first use building) the control plane's binaries.

`hack/build-control-plane.sh` owns the versions and the cache folder they are built into; this module
asks it where that folder is and runs it when a binary is missing, letting its progress reach the
terminal.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from sftjob_dev.errors import ClusterError

BUILD_SCRIPT = Path(__file__).resolve().parent.parent / "build-control-plane.sh"
TOOLS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "helm")


def bin_dir() -> Path:
    """The versioned cache folder the build script uses (whether or not it is filled yet)."""
    try:
        out = subprocess.run(
            ["bash", str(BUILD_SCRIPT), "--print-dir"], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise ClusterError(f"cannot run {BUILD_SCRIPT}: {e}") from e
    return Path(out.strip().splitlines()[-1])


def missing(folder: Path) -> list[str]:
    """Binaries not yet built into `folder`."""
    return [t for t in TOOLS if not (folder / t).is_file()]


def ensure_built() -> Path:
    """Return the bin folder, building whatever is missing first (slow only the first time)."""
    folder = bin_dir()
    todo = missing(folder)
    if not todo:
        return folder
    if shutil.which("go") is None:
        raise ClusterError(
            f"the Go toolchain (go) is not on PATH but {', '.join(todo)} must be built; install Go >= 1.26"
        )
    print(f"building the control plane into {folder} (missing: {', '.join(todo)})", flush=True)
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise ClusterError(
            f"{BUILD_SCRIPT.name} failed with exit code {result.returncode} (its output is above)"
        )
    still = missing(folder)
    if still:
        raise ClusterError(f"the build finished but {', '.join(still)} is missing from {folder}")
    return folder
