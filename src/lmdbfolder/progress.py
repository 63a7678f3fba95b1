"""Progress of long work: a bar on a terminal or in a notebook, lines in a log, or nothing.

Where the progress goes decides its form (``enabled=None``, the default):

* stderr is a terminal: a tqdm bar with samples/s and MB/s;
* a Jupyter notebook (stderr is not a terminal there): tqdm's notebook bar
  when ipywidgets is installed, else the text bar (a notebook cell shows
  carriage returns as a terminal does);
* anything else (Slurm and nohup logs, CI, a pipe): a plain line now and
  then, ``pack: 12,000 of 1,281,167 img (0.9%), 850 img/s, 95 MB/s, about
  25 min left``: the first after 5 s, then at doubling intervals up to one a
  minute, and a last line when the work ends (only if a line was printed: a
  short job stays quiet). No carriage returns, nothing redrawn.

``enabled=True`` forces the tqdm bar wherever stderr goes; ``False`` shows
nothing. tqdm is imported only when a bar is drawn, so ``import lmdbfolder``
stays light and library callers that pass ``progress=False`` never touch it.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

from lmdbfolder.text import printable

__all__ = ["Progress", "LINE_INTERVALS", "in_notebook", "duration"]

#: Seconds between two progress lines (the last one repeats): a short job
#: says something early, an hours-long one adds a line a minute to its log.
LINE_INTERVALS = (5.0, 10.0, 20.0, 40.0, 60.0)


def in_notebook() -> bool:
    """Whether this process is a Jupyter (IPython) kernel."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:  # an IPython too old or too odd to ask: not a notebook we can draw in
        return False
    return shell is not None and getattr(shell, "kernel", None) is not None


def duration(seconds: float) -> str:
    """``"42 s"``, ``"3 min 5 s"``, ``"2 h 10 min"``: a time span for a progress line."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {s} s" if minutes < 10 and s else f"{minutes} min"
    hours, m = divmod(minutes, 60)
    return f"{hours} h {m} min" if m else f"{hours} h"


class Progress:
    """Counts samples and bytes, and shows them as the module docstring says.

    Args:
        total: the amount of work (samples, or bytes with ``unit="B"``).
        desc: what is being done (``"pack"``), the start of every line.
        enabled: None (default): the form that suits where stderr goes; True:
            a tqdm bar; False: nothing.
        initial: work already done (a resumed pack).
        unit: ``"img"`` (default) or ``"B"`` (counts bytes, shown as kB, MB, ...).
        stream: where lines and bars go (default ``sys.stderr``).
        clock: seconds, for the rates and the line cadence (default
            ``time.monotonic``; tests pass their own).
    """

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        enabled: bool | None = None,
        initial: int = 0,
        unit: str = "img",
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = sys.stderr if stream is None else stream
        self._clock = clock
        self._bar: Any = None
        self._bytes = 0
        self._total = total
        self._desc = desc
        self._initial = initial
        self._done = initial
        self._unit = unit
        self._start = clock()
        self._last_postfix = self._start  # first rate once there is half a second to average
        #: Lines printed so far (the log form); the next one is due at ``_next_line``.
        self.lines = 0
        self._next_line: float | None = None
        if enabled is None:
            terminal = _isatty(self._stream)
            if terminal or in_notebook():
                self._bar = self._make_bar(notebook=not terminal)
            else:
                self._next_line = self._start + LINE_INTERVALS[0]
        elif enabled:
            self._bar = self._make_bar(notebook=False)

    def _make_bar(self, *, notebook: bool) -> Any:
        import importlib

        module = "tqdm"
        if notebook:
            try:
                import ipywidgets  # noqa: F401

                module = "tqdm.notebook"  # a widget; without ipywidgets, the text bar
            except ImportError:
                pass
        tqdm: Any = importlib.import_module(module).tqdm
        # No monitor thread (tqdm's default starts one per process, and it stays): a thread
        # beside the writer makes the next pack in this process read with threads instead of
        # worker processes (write.processes.processes_available).
        bar_class = type("Bar", (tqdm,), {"monitor_interval": 0})
        return bar_class(
            total=self._total,
            initial=self._initial,
            desc=self._desc,
            unit=self._unit,
            unit_scale=self._unit == "B",
            dynamic_ncols=True,
            smoothing=0.1,
            file=self._stream,
        )

    def update(self, n: int = 1, nbytes: int = 0) -> None:
        """Record ``n`` more samples and ``nbytes`` more bytes."""
        self._bytes += nbytes
        self._done += n
        if self._next_line is not None:
            now = self._clock()
            if now >= self._next_line:
                self._print_line(now)
                step = LINE_INTERVALS[min(self.lines, len(LINE_INTERVALS) - 1)]
                self._next_line = now + step
            return
        if self._bar is None:
            return
        self._bar.update(n)
        now = self._clock()
        if self._unit != "B" and now - self._last_postfix > 0.5:
            self._last_postfix = now
            self._set_rate(now)

    def write(self, message: str) -> None:
        """Print a line without breaking the bar (in the log form: as a line of its own).

        Control characters other than newlines are escaped: messages name files
        and packs that are anyone's (``text.skipped_line`` escapes newlines too)."""
        message = printable(message, None, newlines=True)
        if self._bar is not None:
            self._bar.write(message, file=self._stream)
        elif self._next_line is not None:
            self._stream.write(message + "\n")
            self._stream.flush()

    def close(self, *, stopped: bool = False) -> None:
        """Finish: the bar keeps its final state on screen (with the overall MB/s); the
        log form ends with a line saying it is done, or where it ``stopped`` (when it
        printed any line)."""
        if self._bar is not None:
            self._set_rate(self._clock())
            self._bar.close()
            self._bar = None
        if self._next_line is not None:
            if self.lines:
                self._print_line(self._clock(), final="stopped after" if stopped else "done in")
            self._next_line = None

    def _amount(self, n: float) -> str:
        if self._unit == "B":
            return f"{n / 1e6:,.0f} MB"
        return f"{int(n):,}"

    def _print_line(self, now: float, *, final: str = "") -> None:
        elapsed = max(now - self._start, 1e-9)
        rate = (self._done - self._initial) / elapsed
        unit = "MB" if self._unit == "B" else self._unit
        if self._unit == "B":
            speed = f"{rate / 1e6:,.0f} MB/s"
        else:
            speed = f"{rate:,.0f} {unit}/s" + (f", {self._bytes / elapsed / 1e6:,.0f} MB/s" if self._bytes else "")
        of = f" of {self._amount(self._total)}" if self._total else ""
        unit_word = "" if self._unit == "B" else f" {unit}"
        share = f" ({self._done / self._total:.1%})" if self._total else ""
        if final:
            tail = f"{final} {duration(elapsed)}"
        elif rate > 0 and self._total:
            tail = f"about {duration(max(0, self._total - self._done) / rate)} left"
        else:
            tail = f"{duration(elapsed)} so far"
        self._stream.write(f"{self._desc}: {self._amount(self._done)}{of}{unit_word}{share}, {speed}, {tail}\n")
        self._stream.flush()
        self.lines += 1

    def _set_rate(self, now: float) -> None:
        if self._bytes and self._unit != "B":  # no MB/s for callers that count no bytes, or count in bytes
            mb_s = self._bytes / max(now - self._start, 1e-9) / 1e6
            self._bar.set_postfix_str(f"{mb_s:.0f} MB/s", refresh=False)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(stopped=exc[0] is not None)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
