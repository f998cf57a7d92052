"""``spec.tracking``: the experiment trackers a job's trainer logs to, and the Secrets it reaches them with.

The trainer's half of the contract is :class:`~sftjob.config.TrackingSettings`, which holds no credential:
those reach the trainer pods as environment variables read from the user's Secrets (:meth:`TrackingSpec.env`),
the names MLflow and Weights & Biases read themselves. TensorBoard needs neither: its event files go on the
checkpoint volume (``TENSORBOARD_DIR``), so they outlive every pod of the job.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import StringConstraints, model_validator

from sftjob.config import MlflowSettings, TrackingSettings, WandbSettings
from sftjob.kube_names import SecretKeyRef, SpecModel

# The patterns are the CRD's, written so that the API server's RE2 and pydantic's regex engine read them
# alike (no \s: RE2's is ASCII, the other's Unicode): no control characters, no spaces.
# An MLflow server the pods reach over HTTP(S), with no user or password in it (those are Secrets': a URL
# is printed, logged and sent to W&B's run config), nor a query or fragment (MLflow appends its API's
# paths to the URL: a query would end up before them).
TRACKING_URI = r"^https?://[^\x00-\x20\x7f/?#@]+(/[^\x00-\x20\x7f?#]*)?$"
# What Weights & Biases accepts in a project or entity name.
WANDB_NAME = r"^[^/\\#?%:\x00-\x20\x7f]+$"
WANDB_DIR_ENV = "WANDB_DIR"  # W&B's local run files: the pod's scratch folder, not the read-only image

TrackingUri = Annotated[str, StringConstraints(min_length=1, max_length=2048, pattern=TRACKING_URI)]
ExperimentName = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f]+$")]
# Basic auth's user name (the password is a Secret's).
UserName = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[^:\x00-\x20\x7f]+$")]
WandbName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=WANDB_NAME)]


class MlflowSpec(MlflowSettings):
    """``spec.tracking.mlflow``: the server, and how the trainer signs in to it (a token, or a user name
    with a password; none for a server without authentication)."""

    tracking_uri: TrackingUri
    experiment: ExperimentName | None = None
    username: UserName | None = None
    password_secret_ref: SecretKeyRef | None = None
    token_secret_ref: SecretKeyRef | None = None

    @model_validator(mode="after")
    def _one_way_to_sign_in(self) -> MlflowSpec:
        if (self.username is None) != (self.password_secret_ref is None):
            raise ValueError("spec.tracking.mlflow.username and passwordSecretRef go together")
        if self.token_secret_ref is not None and self.password_secret_ref is not None:
            raise ValueError(
                "spec.tracking.mlflow takes tokenSecretRef or username with passwordSecretRef, not both"
            )
        return self


class WandbSpec(WandbSettings):
    """``spec.tracking.wandb``: the project the job's run goes to, and the Secret key holding the API key
    (a self-hosted server: ``WANDB_BASE_URL`` in ``spec.env``)."""

    project: WandbName
    entity: WandbName | None = None
    api_key_secret_ref: SecretKeyRef | None = None


class TrackingSpec(SpecModel):
    tensorboard: bool = False
    mlflow: MlflowSpec | None = None
    wandb: WandbSpec | None = None

    def settings(self, tensorboard_dir: str) -> TrackingSettings:
        """The trainer's half: the same trackers, without the credentials."""
        return TrackingSettings(
            tensorboard_dir=tensorboard_dir if self.tensorboard else None,
            mlflow=(
                None
                if self.mlflow is None
                else MlflowSettings(tracking_uri=self.mlflow.tracking_uri, experiment=self.mlflow.experiment)
            ),
            wandb=(
                None
                if self.wandb is None
                else WandbSettings(project=self.wandb.project, entity=self.wandb.entity)
            ),
        )

    def env(self, scratch: str) -> list[dict[str, Any]]:
        """The trainer container's environment for these trackers (``scratch``: its writable folder)."""
        env: list[dict[str, Any]] = []
        if self.mlflow is not None:
            if self.mlflow.token_secret_ref is not None:
                env.append(_from_secret("MLFLOW_TRACKING_TOKEN", self.mlflow.token_secret_ref))
            if self.mlflow.username is not None:
                env.append({"name": "MLFLOW_TRACKING_USERNAME", "value": self.mlflow.username})
            if self.mlflow.password_secret_ref is not None:
                env.append(_from_secret("MLFLOW_TRACKING_PASSWORD", self.mlflow.password_secret_ref))
        if self.wandb is not None:
            if self.wandb.api_key_secret_ref is not None:
                env.append(_from_secret("WANDB_API_KEY", self.wandb.api_key_secret_ref))
            env.append({"name": WANDB_DIR_ENV, "value": scratch})
        return env


def _from_secret(name: str, ref: SecretKeyRef) -> dict[str, Any]:
    """Optional: a Secret or key that is missing leaves the variable unset and the pod starting (the tracker
    then fails to sign in, and is dropped and alerted on: a tracker never stops training)."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key, "optional": True}}}
