"""The emulator's simulated clock.

Provider time runs `time_scale` times faster than real time and can be pushed forward by hand,
so a test can cross a 24 h completion window in milliseconds. Nothing runs in the background:
batch state is derived from `now()` whenever someone looks.
"""

from __future__ import annotations

import threading
import time


class Clock:
    """Simulated unix time: start + real elapsed x time_scale + manual advances."""

    def __init__(self, time_scale: float = 1.0, start: float | None = None) -> None:
        self._lock = threading.Lock()
        self._scale = float(time_scale)
        self._anchor_real = time.monotonic()
        # Start on a whole second so that unix-int timestamps are exact offsets in tests.
        self._anchor_sim = float(int(time.time())) if start is None else float(start)

    @property
    def time_scale(self) -> float:
        return self._scale

    def now(self) -> float:
        with self._lock:
            return self._anchor_sim + (time.monotonic() - self._anchor_real) * self._scale

    def advance(self, seconds: float) -> float:
        """Jump forward by `seconds` simulated seconds; returns the new time."""
        if seconds < 0:
            raise ValueError("The emulator clock only moves forward")
        with self._lock:
            self._anchor_sim += seconds
        return self.now()

    def set_time_scale(self, time_scale: float) -> None:
        """Change speed from now on without making time jump."""
        with self._lock:
            real = time.monotonic()
            self._anchor_sim += (real - self._anchor_real) * self._scale
            self._anchor_real = real
            self._scale = float(time_scale)
