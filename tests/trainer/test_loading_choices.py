"""What the trainer decides about a model before it loads it: the attention that keeps packed examples
apart, the hub token as sent, and what a load failure is classified as (and shows of the token)."""

from __future__ import annotations

import pytest
import torch

from sftjob.config import ModelSource
from sftjob.failures import ExitCode
from sftjob_trainer.attention import VARLEN
from sftjob_trainer.failures import load_failure, one_line
from sftjob_trainer.model import _hub_kwargs, resolve_attention

pytestmark = pytest.mark.trainer
CPU = torch.device("cpu")


def test_packed_rows_use_varlen_attention_only_where_the_model_passes_the_boundaries_to_it() -> None:
    from transformers import LlamaConfig, StableLmConfig

    assert resolve_attention("sdpa", CPU, True, LlamaConfig(), 64) == VARLEN
    # StableLM's attention is its own code: it would never see cu_seq_lens and mix the examples.
    assert resolve_attention("sdpa", CPU, True, StableLmConfig(), 64) == "eager"
    assert resolve_attention("sdpa", CPU, False, StableLmConfig(), 64) == "sdpa"


def test_a_model_without_sdpa_attention_is_loaded_with_eager_instead_of_failing() -> None:
    from transformers import GPTJConfig

    assert resolve_attention("sdpa", CPU, False, GPTJConfig(), 64) == "eager"


def test_the_hub_token_is_sent_without_the_newline_a_secret_file_leaves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijkl\n")
    assert _hub_kwargs(ModelSource(name="org/model"))["token"] == "hf_abcdefghijkl"
    monkeypatch.setenv("HF_TOKEN", "  ")
    assert _hub_kwargs(ModelSource(name="org/model"))["token"] is None


def test_a_token_quoted_in_an_error_never_reaches_the_termination_message() -> None:
    reason = one_line(
        "LocalProtocolError: Illegal header value b'Bearer hf_secretvalue1\\n' for hf_abcdefghij"
    )
    assert "hf_secret" not in reason and "hf_abcdefghij" not in reason and "<redacted>" in reason


def test_an_endpoint_without_a_scheme_is_no_network_failure_to_retry() -> None:
    httpx = pytest.importorskip("httpx2")  # what huggingface_hub 2 talks through
    assert load_failure(httpx.UnsupportedProtocol("Request URL is missing an 'http://'"), "the model") is None
    retried = load_failure(httpx.ConnectTimeout("timed out"), "the model")
    assert retried is not None and retried.code == ExitCode.NETWORK_ERROR
