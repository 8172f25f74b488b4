"""bench/fanout.py against a real etcd: every watcher gets every put, each size is measured,
and its table compares each size with the smallest of the same run."""

from __future__ import annotations

from bench.fanout import Put, main, measure, table


def test_every_watcher_gets_each_put_and_each_size_is_measured() -> None:
    puts = measure(watchers=12, connections=3, sizes=[100, 5000], repeat=2)
    assert [p.size for p in puts] == [100, 5000, 100, 5000]
    assert all(p.deliver_s > 0 and p.client_cpu_s >= 0 and p.etcd_cpu_s >= 0 for p in puts)


def test_the_table_gives_medians_and_the_ratio_to_the_smallest_value() -> None:
    puts = [
        Put(300, 0.2, 0.04, 0.30),
        Put(300, 0.4, 0.06, 0.30),
        Put(40000, 0.5, 0.20, 0.40),
        Put(40000, 0.3, 0.18, 0.44),
    ]
    text = table(2048, puts)
    assert "| 300 | 0.6 | 0.300 | 0.05 | 0.30 | 1.00x |" in text
    assert "| 40000 | 81.9 | 0.400 | 0.19 | 0.42 | 1.74x |" in text


def test_bad_arguments_are_refused_with_exit_code_2() -> None:
    assert main(["--sizes", "300,big"]) == 2
    assert main(["--watchers", "0"]) == 2
