"""Loading the model or the data: a hub outage or a failing disk restarts the job, a bad source fails it.

Each loader is monkeypatched to raise what transformers, huggingface_hub and datasets raise (the same
chains of wrapped exceptions), so no test touches the network.
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sftjob.config import DatasetSource, TrainerConfig
from sftjob.failures import EXIT_CODE_CLASS, PERMANENT, ExitCode, FailureClass, TrainerError
from sftjob_operator.classify import classify_pod
from sftjob_trainer import data, model
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer

HUB = "https://huggingface.co/api/models/org/model"


def _chain(*exceptions: BaseException) -> BaseException:
    """The first exception, raised from the second, raised from the third..."""
    for outer, inner in itertools.pairwise(exceptions):
        outer.__cause__ = inner
    return exceptions[0]


def _http(cls: type[BaseException], status: int) -> BaseException:
    from huggingface_hub.utils import httpx

    response = httpx.Response(status, request=httpx.Request("GET", HUB))
    return cls(f"{status} Client Error for url: {HUB}", response=response)


def connection_refused() -> BaseException:
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.utils import httpx

    return _chain(
        OSError("We couldn't connect to 'https://huggingface.co' to load the files"),
        LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub"),
        httpx.ConnectError("[Errno 111] Connection refused"),
        ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
    )


def read_timeout() -> BaseException:
    import requests

    return requests.exceptions.ReadTimeout("HTTPSConnectionPool(host='huggingface.co'): Read timed out.")


def hub_unavailable() -> BaseException:
    from huggingface_hub.errors import HfHubHTTPError

    return _chain(
        OSError("There was a specific connection error when trying to load org/model"),
        _http(HfHubHTTPError, 503),
    )


def rate_limited() -> BaseException:
    from huggingface_hub.errors import HfHubHTTPError

    return _http(HfHubHTTPError, 429)


def disk_full() -> BaseException:
    return OSError(errno.ENOSPC, "No space left on device", "/root/.cache/huggingface/hub/blob.incomplete")


def disk_failing() -> BaseException:
    return OSError(errno.EIO, "Input/output error", "/models/org/model/model.safetensors")


def repo_not_found() -> BaseException:
    from huggingface_hub.errors import RepositoryNotFoundError

    return _chain(
        OSError("org/model is not a local folder and is not a valid model identifier"),
        _http(RepositoryNotFoundError, 404),
    )


def gated() -> BaseException:
    from huggingface_hub.errors import GatedRepoError

    return _chain(OSError("You are trying to access a gated repo."), _http(GatedRepoError, 403))


def offline_and_not_cached() -> BaseException:
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    return _chain(
        OSError("We couldn't connect to 'https://huggingface.co' to load the files"),
        LocalEntryNotFoundError("Cannot find the requested files in the disk cache"),
        OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is enabled."),
    )


def bad_config() -> BaseException:
    return ValueError("Unrecognized model in org/model. Should have a `model_type` key in its config.json")


def out_of_memory() -> BaseException:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def uncorrectable_ecc() -> BaseException:
    return _chain(
        OSError("Unable to load weights from checkpoint file"),
        torch.AcceleratorError("CUDA error: uncorrectable ECC error encountered"),
    )


def nvlink_failed() -> BaseException:
    return RuntimeError("CUDA error: uncorrectable NVLink error was detected during the execution")


def illegal_memory_access() -> BaseException:
    return torch.AcceleratorError("CUDA error: an illegal memory access was encountered")


def image_without_kernels() -> BaseException:
    return torch.AcceleratorError("CUDA error: no kernel image is available for execution on the device")


def module_missing() -> BaseException:
    return ModuleNotFoundError("No module named 'einops'")


def model_code_needs_packages() -> BaseException:
    return ImportError(  # transformers' check_imports on a model's own modeling file
        "This modeling file requires the following packages that were not found in your environment:"
        " einops, tiktoken. Run `pip install einops tiktoken`"
    )


def dataset_needs_package() -> BaseException:
    return ImportError("To support decoding images, please install 'Pillow'.")


# Each failure with the exit code a restart may fix, or None: the source itself is at fault and the loader
# ends with its own permanent code (MODEL_LOAD_ERROR, DATA_ERROR).
FAILURES: list[tuple[Callable[[], BaseException], ExitCode | None]] = [
    (connection_refused, ExitCode.NETWORK_ERROR),
    (read_timeout, ExitCode.NETWORK_ERROR),
    (hub_unavailable, ExitCode.NETWORK_ERROR),
    (rate_limited, ExitCode.NETWORK_ERROR),
    (disk_full, ExitCode.STORAGE_ERROR),
    (disk_failing, ExitCode.STORAGE_ERROR),
    (out_of_memory, ExitCode.CUDA_OOM),
    # The GPU's fault: retried on another node.
    (uncorrectable_ecc, ExitCode.GPU_UNAVAILABLE),
    (nvlink_failed, ExitCode.GPU_UNAVAILABLE),
    # Not the source's: any other CUDA error is retried; a module the image lacks the operator reads.
    (illegal_memory_access, ExitCode.UNKNOWN),
    (module_missing, ExitCode.UNKNOWN),
    # The image's, on every node: it names spec.image.
    (image_without_kernels, ExitCode.CONFIG_ERROR),
    (model_code_needs_packages, ExitCode.CONFIG_ERROR),
    (dataset_needs_package, ExitCode.CONFIG_ERROR),
    (repo_not_found, None),
    (gated, None),
    (offline_and_not_cached, None),
    (bad_config, None),
]


def _raising(exc: BaseException) -> Callable[..., None]:
    def load(*args: object, **kwargs: object) -> None:
        raise exc

    return load


def _model_loaders(config: TrainerConfig) -> dict[str, tuple[str, Callable[[], object]]]:
    """Each loader of the model, with the transformers class whose from_pretrained it calls."""
    return {
        "tokenizer": ("AutoTokenizer", lambda: model.load_tokenizer(config.model)),
        "model config": ("AutoConfig", lambda: model.load_model_config(config.model)),
        "model": ("AutoModelForCausalLM", lambda: model.load_model(config, torch.device("cpu"), "sdpa")),
    }


@pytest.mark.parametrize("loader", ["tokenizer", "model config", "model"])
@pytest.mark.parametrize(("failure", "expected"), FAILURES, ids=[f.__name__ for f, _ in FAILURES])
def test_model_loads_that_a_restart_may_fix_keep_their_retryable_exit_code(
    trainer_config: MakeConfig,
    monkeypatch: pytest.MonkeyPatch,
    loader: str,
    failure: Callable[[], BaseException],
    expected: ExitCode | None,
) -> None:
    import transformers

    config = TrainerConfig.load(str(trainer_config()))
    cls, load = _model_loaders(config)[loader]
    monkeypatch.setattr(getattr(transformers, cls), "from_pretrained", _raising(failure()))
    with pytest.raises(TrainerError) as raised:
        load()
    assert raised.value.code == (expected or ExitCode.MODEL_LOAD_ERROR)
    assert config.model.path is not None and config.model.path in raised.value.reason


@pytest.mark.parametrize(("failure", "expected"), FAILURES, ids=[f.__name__ for f, _ in FAILURES])
def test_hub_dataset_loads_that_a_restart_may_fix_keep_their_retryable_exit_code(
    monkeypatch: pytest.MonkeyPatch, failure: Callable[[], BaseException], expected: ExitCode | None
) -> None:
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", _raising(failure()))
    with pytest.raises(TrainerError) as raised:
        next(data.read_rows(DatasetSource(name="org/data", split="train")))
    assert raised.value.code == (expected or ExitCode.DATA_ERROR)
    assert "org/data" in raised.value.reason


def test_a_failing_disk_under_a_dataset_file_is_a_storage_error_not_bad_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "train.jsonl"
    file.write_text('{"text": "hello"}\n')
    monkeypatch.setattr(Path, "open", _raising(disk_failing()))
    with pytest.raises(TrainerError) as raised:
        next(data.read_rows(DatasetSource(path=str(file))))
    assert raised.value.code == ExitCode.STORAGE_ERROR and str(file) in raised.value.reason


def test_a_hub_outage_ends_the_attempt_with_network_error_which_the_operator_retries(
    trainer_config: MakeConfig, termination_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _raising(hub_unavailable()))
    assert run(str(trainer_config())) == ExitCode.NETWORK_ERROR
    message = termination_log.read_text().strip()
    assert (
        message.startswith("[exit 18] hub or network unavailable while loading the model from")
        and "503" in message
    )

    # The operator's view: the exit code, or the code its message is tagged with when torchrun exits 1.
    assert EXIT_CODE_CLASS[ExitCode.NETWORK_ERROR] is FailureClass.NETWORK_ERROR
    assert FailureClass.NETWORK_ERROR not in PERMANENT
    assert _operator_class(ExitCode.UNKNOWN, message) is FailureClass.NETWORK_ERROR


def test_a_gpu_fault_while_loading_the_model_ends_the_attempt_gpu_unavailable_not_blaming_the_model(
    trainer_config: MakeConfig, termination_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _raising(uncorrectable_ecc()))
    assert run(str(trainer_config())) == ExitCode.GPU_UNAVAILABLE
    message = termination_log.read_text().strip()
    assert message.startswith("[exit 13] GPU fault: AcceleratorError: CUDA error: uncorrectable ECC error")
    # The operator retries it, avoiding the node, instead of failing the job as the model's fault.
    assert _operator_class(ExitCode.UNKNOWN, message) is FailureClass.GPU_UNAVAILABLE
    assert FailureClass.GPU_UNAVAILABLE not in PERMANENT


def _operator_class(code: int, message: str) -> FailureClass | None:
    from datetime import UTC, datetime

    state = {"terminated": {"exitCode": code, "reason": "Error", "message": message}}
    pod = {
        "metadata": {"name": "job-1-0"},
        "spec": {"nodeName": "gpu-0"},
        "status": {"phase": "Failed", "containerStatuses": [{"name": "trainer", "state": state}]},
    }
    ready = {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    node = {"metadata": {"name": "gpu-0"}, "status": {"conditions": [ready]}}
    return classify_pod(pod, node, now=datetime.now(UTC)).failure_class


@pytest.mark.parametrize("targets", [["qproj"], ["norm"]], ids=["a typo", "a layer lora cannot wrap"])
def test_target_modules_that_fit_no_layer_end_the_job_with_a_config_error_naming_the_field(
    trainer_config: MakeConfig, termination_log: Path, targets: list[str]
) -> None:
    config = trainer_config(lora={"r": 8, "alpha": 16, "dropout": 0.1, "targetModules": targets})
    assert run(str(config)) == ExitCode.CONFIG_ERROR
    message = termination_log.read_text().strip()
    assert message.startswith(f"[exit 10] spec.lora.targetModules {targets} names no layer of the model")
    # The operator fails the job at once instead of retrying it maxRestarts times.
    assert _operator_class(ExitCode.UNKNOWN, message) is FailureClass.CONFIG_ERROR
    assert FailureClass.CONFIG_ERROR in PERMANENT


def test_target_modules_naming_a_mixtures_experts_end_the_job_with_a_config_error_not_restarts(
    trainer_config: MakeConfig, termination_log: Path, tmp_path: Path
) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from sftjob_trainer.tiny import make_tokenizer

    folder, tokenizer = tmp_path / "tiny-moe", make_tokenizer()
    shape = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    Qwen3MoeForCausalLM(shape).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # transformers 5 fuses the experts' gate_proj, up_proj and down_proj into 3-D tensors, which peft adapts
    # only without dropout: the default 0.05 cannot work on any attempt.
    targets = ["q_proj", "gate_proj", "up_proj", "down_proj"]
    config = trainer_config(model={"path": str(folder)}, lora={"dropout": 0.05, "targetModules": targets})
    assert run(str(config)) == ExitCode.CONFIG_ERROR
    message = termination_log.read_text().strip()
    assert message.startswith(f"[exit 10] spec.lora.targetModules {targets} reaches the experts")
    assert _operator_class(ExitCode.UNKNOWN, message) is FailureClass.CONFIG_ERROR
