"""`bench.cpu_prefetch`: its on ÷ off arithmetic, and a whole run on a tiny model."""

import json

from bench.cpu_prefetch import main, ratios


def test_ratios_pair_each_prefetch_row_with_the_same_repeats_row_without():
    rows = [
        {"policy": "lru", "prefetch": False, "tpot_ms": 100.0},
        {"policy": "lru", "prefetch": True, "tpot_ms": 90.0},
        {"policy": "lru", "prefetch": False, "tpot_ms": 80.0},
        {"policy": "lru", "prefetch": True, "tpot_ms": 100.0},
    ]
    assert ratios(rows) == {"lru": [0.9, 1.25]}


def test_a_tiny_run_prints_every_row_and_the_ratios(tmp_path, capsys):
    main(["--tiny", "--repeats", "1", "--rounds", "1", "--tokens", "3", "--workdir", str(tmp_path)])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rows, summary = lines[:-1], lines[-1]
    assert [(row["policy"], row["prefetch"]) for row in rows] == [
        ("lru", False), ("lru", True), ("sparsity-aware", False), ("sparsity-aware", True)]  # fmt: skip
    assert all(row["cache"] == "32/128" and 0 <= row["hit_rate"] <= 1 for row in rows)
    assert all(row["prefetches_per_token"] == 0 for row in rows if not row["prefetch"])
    assert summary["kind"] == "ratios" and set(summary["prefetch_on_over_off"]) == {"lru", "sparsity-aware"}
