"""Create objects at a steady rate from a thread pool and remember when each create was sent.

One Python process with a pool of API connections, not one kubectl per object: the harness must be
able to offer more load than the controller under test can take. A create's time is when its request
was sent (what a user would call "I created the job"); responses are not deserialized.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

Create = Callable[[str], None]


@dataclass
class Created:
    """Send times (``time.monotonic``) of the creates that succeeded, and the ones that failed."""

    sent: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    started: float = 0.0
    finished: float = 0.0

    @property
    def rate(self) -> float:
        """Creates per second actually achieved."""
        span = self.finished - self.started
        return len(self.sent) / span if span > 0 else 0.0


def create_at_rate(create: Create, names: Sequence[str], rate: float, workers: int) -> Created:
    """Call ``create(name)`` for every name, starting the i-th at ``i / rate`` seconds; wait for all."""
    result = Created()
    lock = threading.Lock()

    def one(name: str) -> None:
        sent = time.monotonic()
        try:
            create(name)
        except Exception as err:  # a failed create is reported, not fatal: the rest still measure
            with lock:
                result.errors[name] = str(err)[:300]
            return
        with lock:
            result.sent[name] = sent

    result.started = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="create") as pool:
        for i, name in enumerate(names):
            delay = result.started + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, name)
    result.finished = time.monotonic()
    return result
