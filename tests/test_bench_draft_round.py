"""bench.draft_round's bar lines (CPU): issue 11's SmolLM2 ratio read from the medians of
alternated timings when the run took them, else from its one step timing."""

from __future__ import annotations

from bench.draft_round import alternated_table, check_bars


def _row(lm_head: str, round_us: float) -> dict:
    return dict(
        model="eagle-smollm2-135m", batch=1, k=3, mode="greedy", lm_head=lm_head,
        round_us=round_us, graph_launches=1.0, round_over_steps_bar=1.0, host_busy_us=20.0,
        host_us=15.0, launch_idle_us=4.0, host_own_busy_us=12.0, launch_busy_us=5.0,
        noop_busy_us=0.3,
        host_burst_us=9.0, host_burst_p90_us=10.0, capture_s_per_graph=1.0,
        capture_again_s_per_graph=0.01,
    )  # fmt: skip


def _alt():
    runs = [
        {"step_us": 430.0, "bf16_round_us": 124.0, "int8_round_us": 95.0},
        {"step_us": 480.0, "bf16_round_us": 123.0, "int8_round_us": 94.0},
        {"step_us": 470.0, "bf16_round_us": 125.0, "int8_round_us": 96.0},
    ]
    for r in runs:
        for h in ("bf16", "int8"):
            r[f"{h}_ratio"] = r[f"{h}_round_us"] / r["step_us"]
    keys = list(runs[0])
    median = {k: sorted(r[k] for r in runs)[1] for k in keys}
    return {"runs": runs, "median": median}


def test_the_ratio_bar_reads_the_medians_of_alternated_timings():
    rows = [_row("bf16", 124.0), _row("int8", 95.0)]
    alt = _alt()
    lines = [b for b in check_bars(rows, 430.0, alt) if b.startswith("SmolLM2-shaped")]
    assert len(lines) == 2
    int8 = next(b for b in lines if "int8" in b)
    # the runs' ratios 95/430, 94/480, 96/470: 0.221, 0.196, 0.204 -> median 0.204
    assert "median of 3 alternated timings: 0.204 (runs 0.196-0.221): MISSED" in int8, int8
    # the run's single step timing (430 µs) would have given 95 / 430 = 0.221
    single = [b for b in check_bars(rows, 430.0) if "int8" in b and "SmolLM2" in b][0]
    assert "0.221 (MISSED" in single and "alternated" not in single, single
    met = [b for b in check_bars(rows, 500.0) if "int8" in b and "SmolLM2" in b][0]
    assert "0.190 (met" in met, met


def test_the_ratio_bar_is_judged_against_the_faster_step():
    """The step timed first in the process (faster: see bench.draft_round.main) gives the
    larger ratio, and the bar reads it: alternated medians alone would read met."""
    rows = [_row("bf16", 124.0), _row("int8", 95.0)]
    alt = _alt()
    for r in alt["runs"] + [alt["median"]]:
        r["step_us"] += 100.0  # a slow step in turns: 95 / 570 etc., all met
        for h in ("bf16", "int8"):
            r[f"{h}_ratio"] = r[f"{h}_round_us"] / r["step_us"]
    int8 = next(b for b in check_bars(rows, 570.0, alt) if "int8" in b and "SmolLM2" in b)
    assert int8.endswith(": met (bar 0.2)"), int8
    int8 = next(b for b in check_bars(rows, 570.0, alt, 400.0) if "int8" in b and "SmolLM2" in b)
    # the int8 round's median 95 µs over the first step's 400: 0.2375
    assert "against the step timed first (400.0 µs) 0.237" in int8, int8
    assert int8.endswith(": MISSED (bar 0.2)"), int8
    single = next(b for b in check_bars(rows, 570.0, None, 400.0) if "int8" in b and "SmolLM" in b)
    assert "0.237 (MISSED" in single, single


def test_alternated_table_lists_every_run_and_the_median():
    text = alternated_table(_alt())
    lines = text.splitlines()
    assert lines[0].startswith("| run | step_us | bf16_round_us")
    assert [ln.split("|")[1].strip() for ln in lines[2:]] == ["1", "2", "3", "median"]


def test_the_host_bar_reads_rounds_enqueued_back_to_back():
    """The 30 µs bar is the back-to-back figure; the per-call ones are listed beside it."""
    slow_calls = _row("int8", 95.0) | dict(host_busy_us=45.0, host_own_busy_us=41.0)
    bar = next(b for b in check_bars([slow_calls], 500.0) if b.startswith("host <= 30"))
    assert "met (worst 9.0 µs, p90 10.0" in bar, bar
    info = next(b for b in check_bars([slow_calls], 500.0) if "for information" in b)
    assert "worst 45.0 µs" in info and "input_views worst 41.0 µs" in info, info
    slow_burst = _row("int8", 95.0) | dict(host_burst_us=31.0, host_burst_p90_us=33.0)
    bar = next(b for b in check_bars([slow_burst], 500.0) if b.startswith("host <= 30"))
    assert "MISSED (worst 31.0 µs, p90 33.0" in bar, bar
