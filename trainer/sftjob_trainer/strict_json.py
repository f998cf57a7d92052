"""JSON that other programs read: a non-finite number (a NaN loss, an infinite gradient norm) as ``null``.

Python's ``json.dumps`` writes NaN and Infinity as bare ``NaN`` and ``Infinity`` by default, which is
not JSON: ``jq``, JavaScript, Go and the API server reject the whole document. ``summary.json``,
``train_log.jsonl`` and the progress annotations go through :func:`dumps`, so a diverged step leaves
valid JSON with ``null`` where its loss would be.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float inside it (dicts, lists, tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`finite` ``(value)``; never writes NaN or Infinity."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
