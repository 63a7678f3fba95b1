"""A progress bar with samples/s and MB/s, or nothing at all.

tqdm is imported only when a bar is shown, so ``import lmdbfolder`` stays
light and library callers that pass ``progress=False`` never touch it.
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["Progress"]


class Progress:
    """Counts samples and bytes; draws a tqdm bar on stderr when ``enabled``.

    ``enabled=None`` means: draw only when stderr is a terminal. ``unit="B"``
    counts bytes (shown as kB, MB, ...).
    """

    def __init__(
        self, total: int, desc: str, *, enabled: bool | None = None, initial: int = 0, unit: str = "img"
    ) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._bar: Any = None
        self._bytes = 0
        self._start = time.perf_counter()
        self._last_postfix = self._start  # first rate once there is half a second to average
        self._unit = unit
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit=unit,
                unit_scale=unit == "B",
                dynamic_ncols=True,
                smoothing=0.1,
                file=sys.stderr,
            )

    def update(self, n: int = 1, nbytes: int = 0) -> None:
        """Record ``n`` more samples and ``nbytes`` more bytes."""
        self._bytes += nbytes
        if self._bar is None:
            return
        self._bar.update(n)
        now = time.perf_counter()
        if self._unit != "B" and now - self._last_postfix > 0.5:
            self._last_postfix = now
            self._set_rate(now)

    def write(self, message: str) -> None:
        """Print a line without breaking the bar."""
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)

    def close(self) -> None:
        """Finish the bar (leaves the final line on screen, with the overall MB/s)."""
        if self._bar is not None:
            self._set_rate(time.perf_counter())
            self._bar.close()
            self._bar = None

    def _set_rate(self, now: float) -> None:
        if self._bytes and self._unit != "B":  # no MB/s for callers that count no bytes, or count in bytes
            mb_s = self._bytes / max(now - self._start, 1e-9) / 1e6
            self._bar.set_postfix_str(f"{mb_s:.0f} MB/s", refresh=False)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
