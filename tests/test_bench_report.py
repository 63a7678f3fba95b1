"""The words of `lmdbfolder bench` (never a loss called a gain, "fastest" only for what
measured fastest, singular and plural), and the threads of its in-process runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lmdbfolder.bench.run import (
    DEFAULT,
    FILES,
    FUSED,
    RAW_BATCH,
    RAW_GET,
    BenchConfig,
    BenchResult,
    _Best,
    _others,
    _recommend,
    _summarize,
    format_report,
    versus,
)
from lmdbfolder.bench.timing import CpuMeter, Measurement, proc_cpu_sample, time_loader


def measured(rates: dict[tuple[str, str, int], float]) -> _Best:
    best = _Best()
    for (contestant, workload, workers), per_second in rates.items():
        best.add(Measurement(contestant, workload, workers, 1000, 100_000_000, 1000 / per_second))
    return best


RATES = {
    (FILES, "raw read, cold", 0): 1000.0,
    (RAW_GET, "raw read, cold", 0): 920.0,
    (RAW_BATCH, "raw read, cold", 0): 900.0,
    (FILES, "train pipeline, warm", 1): 100.0,
    (DEFAULT, "train pipeline, warm", 1): 181.0,
    (FUSED, "train pipeline, warm", 1): 150.0,
}


def test_versus_never_calls_a_loss_a_gain() -> None:
    assert versus(1.81, "ImageFolder") == "1.81x faster than ImageFolder"
    assert versus(0.92, "plain files") == "slower than plain files (0.92x)"
    assert versus(1.02, "plain files") == "about as fast as plain files (1.02x)"


def test_recommendation_names_what_measured_fastest_and_says_slower() -> None:
    cfg = BenchConfig(src=".", workers=[1])
    best = measured(RATES)
    text = _recommend(best, cfg, _summarize(best, cfg, {}))
    assert text.startswith(f"Fastest measured: {DEFAULT} with 1 worker.")  # the default beat the fused crop here
    assert "LMDBFolder(...) with its defaults, num_workers=1" in text and "fused" not in text
    assert "the training pipeline is 1.81x faster than ImageFolder (warm cache)" in text
    assert f"cold raw reads ({RAW_GET}) are slower than plain files (0.92x)" in text
    assert "0.92x plain files" not in text and "pays off here" in text


def test_recommendation_when_packing_buys_nothing() -> None:
    cfg = BenchConfig(src=".", workers=[1])
    rates = dict(RATES)
    rates[(DEFAULT, "train pipeline, warm", 1)] = 101.0
    rates[(FUSED, "train pipeline, warm", 1)] = 102.0
    best = measured(rates)
    text = _recommend(best, cfg, _summarize(best, cfg, {}))
    assert text.startswith(f"Fastest measured: {FUSED} with 1 worker.")
    assert "packing buys little on this machine" in text and "about as fast as ImageFolder (1.02x)" in text
    assert "plain files are fine here" in text


def result_with(repeat: int, workers: list[int]) -> BenchResult:
    cfg = BenchConfig(src=".", workers=workers, repeat=repeat)
    best = measured({(c, w, workers[-1] if w.startswith("train") else 0): r for (c, w, _), r in RATES.items()})
    summary = _summarize(best, cfg, {})
    config: dict[str, Any] = {"repeat": repeat, "size": 224, "batch_size": 64, "limit": 1000, "settings": {}}
    return BenchResult(config, {"cpus": 1}, 1000, 10**8, {"size": 10**8}, "evicted", list(best.runs.values()), summary)


@pytest.mark.parametrize(
    "repeat, workers, said, unsaid",
    [
        (1, [1], ["one run per contestant", "1 CPU;", "train pipeline, warm, 1 worker:"], ["median of 1", "1 workers"]),
        (3, [2], ["the fastest of 3 alternated runs", "train pipeline, warm, 2 workers:"], ["one run per contestant"]),
    ],
)
def test_report_numbers_agree_with_their_nouns(
    repeat: int, workers: list[int], said: list[str], unsaid: list[str]
) -> None:
    text = format_report(result_with(repeat, workers))
    for words in said:
        assert words in text, words
    for words in unsaid:
        assert words not in text, words
    assert f"raw read, cold: {RAW_BATCH} is slower than plain files (0.90x)" in text
    assert "fastest =" not in text


class ThreadsSeen(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Records torch's intra-op thread count whenever a sample is loaded."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.seen.append(torch.get_num_threads())
        return torch.zeros(3), 0


def test_in_process_runs_use_one_torch_thread_like_workers() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ds = ThreadsSeen()
        m = time_loader(ds, contestant="x", workers=0, batch_size=4)
        assert m.images == 8 and ds.seen == [1] * 8  # as in a DataLoader worker
        assert torch.get_num_threads() == 2  # restored afterwards
    finally:
        torch.set_num_threads(before)


def test_bench_says_which_temporary_folders_it_makes(small_tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lmdbfolder.cli import main

    argv = ["bench", str(small_tree), "--workers", "0", "--repeat", "1", "--warm-only", "--no-chart", "--limit", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "packs for the bench go to the temporary folder " in out and "deleted the temporary folder " in out
    assert "  train pipeline, warm, 0 workers, LMDBFolder default: " in out  # each measurement as it is made
    assert "0 workers: the main process, torch.set_num_threads(1) like a DataLoader worker" in out


# -- repeated runs and a shared machine ---------------------------------------------------------------------
def run(contestant: str, per_second: float, others: float | None = 0.0, workers: int = 1) -> Measurement:
    seconds = 1000 / per_second
    return Measurement(
        contestant, "train pipeline, warm", workers, 1000, 0, seconds, cpu_seconds=seconds * 0.9,
        others_cpu_seconds=None if others is None else others * seconds, cpu_wall_seconds=seconds,
    )  # fmt: skip


def report_of(best: _Best, cpus: int = 2, repeat: int = 2) -> tuple[BenchResult, str]:
    cfg = BenchConfig(src=".", workers=[1], repeat=repeat, cold=False)
    summary = _summarize(best, cfg, {})
    summary["spread"] = best.spreads()
    summary["others"] = _others(best.every_run(), cpus)
    config: dict[str, Any] = {"repeat": repeat, "size": 224, "batch_size": 64, "limit": 1000, "settings": {}}
    result = BenchResult(config, {"cpus": cpus}, 1000, 10**8, {"size": 10**8}, "-", list(best.runs.values()), summary)
    result.recommendation = _recommend(best, cfg, summary)
    return result, format_report(result)


def test_a_stalled_run_does_not_decide_the_ratio_and_the_disagreement_is_said() -> None:
    # Two runs each; ImageFolder's second stalled (10 img/s). Its median of two was the
    # stall, and LMDBFolder came out "41.84x faster" with no word about it.
    best = _Best()
    for m in (run(FILES, 350.0), run(DEFAULT, 420.0), run(DEFAULT, 418.4), run(FILES, 10.0, others=1.5)):
        best.add(m)
    result, text = report_of(best)
    assert best.get(FILES, "train pipeline, warm", 1).images_per_second == pytest.approx(350.0)  # type: ignore[union-attr]
    assert result.summary["train_warm_default_vs_files_1w"] == pytest.approx(1.2)
    assert "41.84x" not in text and "1.20x faster than ImageFolder" in text
    wide = [s for s in result.summary["spread"] if s["spread"] and s["spread"] >= 1.2]
    assert [(s["contestant"], s["runs"]) for s in wide] == [(FILES, [350.0, 10.0])]
    assert text.count("runs disagree: ") == 1 and "350, 10 img/s (35.00x apart" in text
    assert "other processes used 0.00, 1.50 CPUs in those runs" in text
    assert "repeated runs disagreed (1 measurement, listed above)" in result.recommendation


def test_other_processes_cpu_flags_a_shared_machine() -> None:
    quiet, busy = _Best(), _Best()
    for best, others in ((quiet, 0.05), (busy, 1.2)):
        best.add(run(FILES, 100.0, others=others))
        best.add(run(DEFAULT, 150.0, others=others))
    _, text = report_of(quiet)
    assert "shared machine" not in text and "Caution" not in text
    assert "CPU ms/img" in text and "others" in text  # the columns are there either way
    result, text = report_of(busy)
    assert result.summary["others"] == {"measured": True, "mean_cpus": 1.2, "max_cpus": 1.2, "busy": True}
    assert "shared machine: other processes kept 1.20 of 2 CPUs busy on average" in text
    assert "this machine is shared" in result.recommendation and "only directional" in result.recommendation
    unknown = _Best()
    unknown.add(run(FILES, 100.0, others=None))
    assert _others(unknown.every_run(), 2) == {
        "measured": False,
        "mean_cpus": None,
        "max_cpus": None,
        "busy": False,
        "why": "/proc/stat cannot be read here",
    }
    _, text = report_of(unknown)
    assert "other processes' CPU use is unknown: /proc/stat cannot be read here" in text


def test_the_report_says_why_other_processes_cpu_is_unknown_on_short_runs() -> None:
    # Every run of a small bench is shorter than the kernel's CPU ticks can tell, and
    # the report once blamed a missing /proc/stat for it on Linux.
    short = _Best()
    short.add(run(FILES, 5000.0, others=None))  # 1000 images in 0.2 s
    short.add(run(DEFAULT, 4000.0, others=None))
    result, text = report_of(short)
    assert "no /proc/stat" not in text and "cannot be read" not in text
    assert "other processes' CPU use is unknown: every run took less than 0.5 s" in text
    assert "--limit" in result.summary["others"]["why"]


def test_cpu_meter_counts_what_others_used() -> None:
    # Readings as (machine busy CPU-seconds, this tree's CPU-seconds), and a wall clock.
    readings = iter([(100.0, 10.0), (103.5, 11.0)])
    clock = iter([0.0, 2.0])
    use = CpuMeter(sample=lambda: next(readings), clock=lambda: next(clock), cpus=2).start().stop()
    assert (use.wall, use.own, use.others) == (2.0, 1.0, 2.5)  # 3.5 busy, 1.0 of it ours
    readings = iter([(100.0, 10.0), (100.2, 10.1)])
    clock = iter([0.0, 0.1])
    short = CpuMeter(sample=lambda: next(readings), clock=lambda: next(clock)).start().stop()
    assert short.own == pytest.approx(0.1) and short.others is None  # too short for 10 ms ticks
    readings = iter([(None, 1.0), (None, 2.0)])  # type: ignore[list-item]
    clock = iter([0.0, 5.0])
    assert CpuMeter(sample=lambda: next(readings), clock=lambda: next(clock)).start().stop().others is None


def test_the_tree_cpu_includes_child_processes() -> None:
    import subprocess
    import sys

    before = proc_cpu_sample()
    code = "import time\nstart = time.process_time()\nwhile time.process_time() - start < 0.3: pass"
    subprocess.run([sys.executable, "-c", code], check=True)  # reaped: its CPU time is this tree's now
    after = proc_cpu_sample()
    # The kernel accounts a child's CPU in clock ticks, sampled, and the difference of two
    # float sums is not exact: 0.3 s of work read 31.83 - 31.53 = 0.2999... in a clean
    # checkout's run. Without the children it reads ~0.
    assert after[1] - before[1] >= 0.2
    if before[0] is not None:
        # /proc/stat's totals are sampled at each timer tick, not accounted exactly as a
        # process's own time is: on a VM 0.3 s of work can show as 0.28 s there
        assert after[0] is not None and after[0] - before[0] >= 0.15  # the machine saw it too
