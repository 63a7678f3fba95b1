"""Progress where stderr goes: lines in logs (Slurm, nohup, CI), a bar on a terminal and in notebooks.

Time is a fake clock here: the tests count lines, never wait.
"""

from __future__ import annotations

import io
import re
import sys
import types
import warnings
from pathlib import Path

import pytest

from conftest import write
from lmdbfolder import progress
from lmdbfolder.errors import SkippedFilesWarning
from lmdbfolder.progress import LINE_INTERVALS, Progress, duration, in_notebook
from lmdbfolder.write.writer import pack


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


LINE = re.compile(r"^pack: [\d,]+ of 1,000 img \(\d+\.\d%\), [\d,]+ img/s, [\d,]+ MB/s, about [\dhmins ]+ left$")


def test_lines_at_growing_intervals_when_stderr_is_not_a_terminal() -> None:
    out, clock = io.StringIO(), Clock()
    with Progress(1000, "pack", stream=out, clock=clock) as bar:
        for _ in range(1000):
            clock.now += 0.1  # 100 s in all, 10 img/s
            bar.update(1, 100_000)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # after 5 s, then 10, 20 and 40 s later (at 15, 35 and 75 s); the next would be at 135 s
    assert len(lines) == 5 and bar.lines == 5
    assert all(LINE.match(line) for line in lines[:4]), lines
    assert lines[0].startswith("pack: 50 of 1,000 img (5.0%), 10 img/s, 1 MB/s, about 1 min 35 s left")
    assert lines[-1] == "pack: 1,000 of 1,000 img (100.0%), 10 img/s, 1 MB/s, done in 1 min 40 s"
    assert LINE_INTERVALS[:4] == (5.0, 10.0, 20.0, 40.0) and LINE_INTERVALS[-1] == 60.0


def test_an_hour_long_job_adds_a_line_a_minute() -> None:
    out, clock = io.StringIO(), Clock()
    with Progress(3600, "pack", stream=out, clock=clock) as bar:
        for _ in range(3600):
            clock.now += 1.0
            bar.update()
    # 5, 15, 35, 75 s, then every 60 s up to 3600 s: 4 + 58, and the last line
    assert bar.lines == 4 + (3600 - 75) // 60 + 1


def test_a_short_job_stays_quiet_and_a_stopped_one_says_so() -> None:
    out, clock = io.StringIO(), Clock()
    with Progress(10, "verify", stream=out, clock=clock) as bar:
        for _ in range(10):
            clock.now += 0.1
            bar.update()
    assert out.getvalue() == "" and bar.lines == 0
    with pytest.raises(KeyboardInterrupt), Progress(100, "pack", stream=out, clock=clock, initial=40) as bar:
        clock.now += 6
        bar.update(5)
        raise KeyboardInterrupt
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("pack: 45 of 100 img (45.0%), 1 img/s")  # a resumed job's rate counts this run only
    assert lines[1].startswith("pack: 45 of 100 img (45.0%)") and lines[1].endswith("stopped after 6 s")


def test_bytes_and_messages_in_the_log_form() -> None:
    out, clock = io.StringIO(), Clock()
    with Progress(50_000_000, "warm", stream=out, clock=clock, unit="B") as bar:
        bar.write("a message")
        clock.now += 10
        bar.update(10_000_000, 10_000_000)
    lines = out.getvalue().splitlines()
    assert lines[0] == "a message"
    assert lines[1] == "warm: 10 MB of 50 MB (20.0%), 1 MB/s, about 40 s left"


def test_a_bar_on_a_terminal_and_nothing_when_disabled() -> None:
    term, clock = Terminal(), Clock()
    with Progress(10, "pack", stream=term, clock=clock) as bar:
        clock.now += 30
        bar.update(10)
    assert bar.lines == 0 and "10/10" in term.getvalue()  # tqdm's bar, not lines
    off = io.StringIO()
    with Progress(10, "pack", stream=off, clock=clock, enabled=False) as bar:
        clock.now += 30
        bar.update(10)
    assert off.getvalue() == ""


def test_a_bar_in_a_notebook(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not in_notebook()
    shell = types.SimpleNamespace(kernel=object())
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    assert in_notebook()
    out, clock = io.StringIO(), Clock()  # a notebook's stderr is no terminal
    with Progress(10, "pack", stream=out, clock=clock) as bar:
        clock.now += 30
        bar.update(10)
    assert bar.lines == 0 and "10/10" in out.getvalue()


def test_durations() -> None:
    assert [duration(s) for s in (0.4, 42, 185, 600, 3599, 7800)] == [
        "0 s",
        "42 s",
        "3 min 5 s",
        "10 min",
        "59 min",
        "2 h 10 min",
    ]


def test_pack_prints_progress_lines_into_a_log(
    small_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # pytest's captured stderr is no terminal, as a Slurm log is not: a pack with the
    # default progress=None prints lines there (a line at every update with no interval).
    monkeypatch.setattr(progress, "LINE_INTERVALS", (0.0,))
    write(small_tree / "class0" / "zz_empty.jpg", b"")
    with pytest.warns(UserWarning):
        pack(small_tree, tmp_path / "p", workers=1)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert any(line.startswith("pack: 1 of 13 img (7.7%), ") and line.endswith(" left") for line in lines), err
    assert "skipped class0/zz_empty.jpg: empty file (0 bytes)" in lines
    assert lines[-1].startswith("pack: 13 of 13 img (100.0%)") and " done in " in lines[-1]
    assert "\r" not in err


@pytest.mark.parametrize("how", ["pack", "sharded", "update", "sharded update"])
def test_the_live_skipped_line_escapes_control_characters_in_file_names(
    small_tree: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    how: str,
) -> None:
    # A file name is anyone's: "\x1b[2J" cleared the terminal, "\r" overwrote the line.
    from lmdbfolder.write.shards import pack_sharded

    monkeypatch.setattr(progress, "LINE_INTERVALS", (0.0,))
    shards = {"shards": 2} if "sharded" in how else {}
    run = pack_sharded if shards else pack
    if "update" in how:
        run(small_tree, tmp_path / "p", progress=False, **shards)
    write(small_tree / "class0" / "zz\x1b[2J\rgone.jpg", b"not an image")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run(small_tree, tmp_path / "p", update="update" in how, **shards)
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err
    said = [str(w.message) for w in seen if issubclass(w.category, SkippedFilesWarning)]
    assert all("\x1b" not in text and "\r" not in text and "zz\\x1b[2J\\x0dgone.jpg" in text for text in said)
    assert any(line.startswith("skipped class0/zz\\x1b[2J\\x0dgone.jpg: ") for line in err.splitlines()), err


def test_a_bar_leaves_no_thread_behind() -> None:
    # tqdm starts a monitor thread with its first bar, and it stays: the next pack in
    # the same process then read with threads instead of worker processes.
    import io
    import threading

    before = threading.active_count()
    with Progress(10, "test", enabled=True, stream=io.StringIO()) as bar:
        bar.update(5)
    assert threading.active_count() == before
