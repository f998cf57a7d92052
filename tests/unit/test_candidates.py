"""The planner's request and fixed choices: a packed-row length the user fixed is used as given, and one
longer than the sequence length is refused instead of being shortened silently."""

from __future__ import annotations

import pytest

from sftjob.candidates import PlanRequest, fixed_choices
from sftjob.gpus import profile_for_type
from sftjob.model_shapes import resolve_architecture

LLAMA_8B = resolve_architecture("meta-llama/Llama-3.1-8B")


@pytest.mark.parametrize(("packing_length", "rows"), [(None, 4096), (1024, 1024), (4096, 4096)])
def test_packed_rows_are_the_fixed_length_or_the_sequence_length(
    packing_length: int | None, rows: int
) -> None:
    request = PlanRequest(architecture=LLAMA_8B, max_seq_length=4096, packing_length=packing_length)
    fixed, _ = fixed_choices(request, profile_for_type("A800"))
    assert fixed.sequence == rows
