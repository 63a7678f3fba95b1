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
    _recommend,
    _summarize,
    format_report,
    versus,
)
from lmdbfolder.bench.timing import Measurement, time_loader


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
        (3, [2], ["median of 3 alternated runs", "train pipeline, warm, 2 workers:"], ["one run per contestant"]),
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
