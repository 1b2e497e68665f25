"""Smoke test of ``benchmarks/micro_batch_allocator.py --quick``: fresh processes under both allocator settings give a
row each with finite positive ratios. No timing thresholds (RESULTS.md holds the numbers)."""


def test_quick_run_gives_a_row_per_model_and_setting(load_benchmark):
    text = load_benchmark("micro_batch_allocator").main(["--quick", "--processes", "1", "--rounds", "1", "--steps", "2",
                                                         "--models", "MLP", "--methods", "micro_batch"])
    rows = [line.split(" | ") for line in text.splitlines()[2:]]
    assert [row[2] for row in rows] == ["glibc as it comes", "mmap and trim thresholds pinned at 1 GiB"]
    for row in rows:
        assert float(row[4]) > 0 and 0 < float(row[-1].rstrip("× |")) < 10
