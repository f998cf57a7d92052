"""Volumes a spec names (the model, the dataset, checkpoints, the output): typed, as the API server checks
them in the pods, so an admitted job's pods are not refused for a volume.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import StringConstraints, field_validator, model_validator

from sftjob.kube_names import ObjectName, SpecModel


def writable(volume: VolumeSource | None, field: str) -> None:
    source = None if volume is None else volume.persistent_volume_claim or volume.nfs
    if source is not None and source.read_only:
        raise ValueError(f"{field} must be writable: remove readOnly")


def relative_path(path: str | None, field: str) -> str | None:
    if path is not None and (path.startswith("/") or ".." in path):
        raise ValueError(f"{field} must be a relative path inside the volume without '..', got {path!r}")
    return path


class PersistentVolumeClaimSource(SpecModel):
    claim_name: ObjectName
    read_only: bool = False


class NfsSource(SpecModel):
    server: Annotated[str, StringConstraints(min_length=1, max_length=253)]
    path: Annotated[str, StringConstraints(min_length=1, max_length=1024, pattern=r"^/")]
    read_only: bool = False


class HostPathSource(SpecModel):
    path: Annotated[str, StringConstraints(min_length=1, max_length=1024, pattern=r"^/")]

    @field_validator("path")
    @classmethod
    def _no_backsteps(cls, path: str) -> str:
        if ".." in path.split("/"):
            raise ValueError(f"hostPath.path {path!r} must not contain a '..' segment")
        return path


class VolumeSource(SpecModel):
    """Where data lives: exactly one of a PersistentVolumeClaim, an NFS export or a host path."""

    persistent_volume_claim: PersistentVolumeClaimSource | None = None
    nfs: NfsSource | None = None
    host_path: HostPathSource | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> VolumeSource:
        given = [s for s in (self.persistent_volume_claim, self.nfs, self.host_path) if s is not None]
        if len(given) != 1:
            raise ValueError("volume needs exactly one of persistentVolumeClaim, nfs or hostPath")
        return self

    def to_kubernetes(self) -> dict[str, object]:
        """The Pod ``volumes[]`` source block (without the name)."""
        return self.model_dump(by_alias=True, exclude_none=True)
