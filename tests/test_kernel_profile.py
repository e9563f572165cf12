"""bench.kernel_profile off the GPU: its table lists the longest kernel first; unknown
cases are refused by name; without a GPU it says so and exits 2 (it measures on CUDA)."""

from __future__ import annotations

import pytest
import torch

from bench import kernel_profile


def test_unknown_case_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        kernel_profile.main(["--cases", "smollm2-135m,llama-7b"])
    assert e.value.code == 2
    assert "llama-7b" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU path measures")
def test_without_a_gpu_it_exits_2(capsys):
    assert kernel_profile.main(["--cases", "eagle-smollm2"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().out


def test_kernel_table_lists_the_longest_kernel_first_with_its_share():
    per = {"short": [2.0, 3.0, 1.0], "long": [1.0, 12.0, 4.5], "middle": [1.0, 5.0, 0.0]}
    lines = kernel_profile.kernel_table(per, 40.0)
    assert lines[0] == (
        "| kernel | a replay | µs a replay | share | critical path µs | µs a launch |"
    )
    assert [line.split("`")[1] for line in lines[2:]] == ["long", "middle", "short"]
    assert lines[2] == "| `long` | 1 | 12.0 | 30.0% | 4.5 | 4.50 |"
    assert lines[4] == "| `short` | 2 | 3.0 | 7.5% | 1.0 | 0.50 |"


def test_critical_path_charges_each_kernel_what_its_end_adds():
    # PDL-style overlap: b starts inside a and waits; c starts inside b and ends
    # before it (adds nothing); then an idle gap; d alone.
    spans = [("b", 2.0, 9.0), ("a", 0.0, 5.0), ("c", 6.0, 8.0), ("d", 12.0, 13.5),
             ("a", 13.0, 14.0)]  # fmt: skip
    added, idle = kernel_profile.critical_path(spans)
    assert added == {"a": 5.0 + 0.5, "b": 4.0, "c": 0.0, "d": 1.5}
    assert idle == 3.0
    assert sum(added.values()) + idle == 14.0  # the whole span, first start to last end
    assert kernel_profile.critical_path([]) == ({}, 0.0)


def test_critical_path_sums_to_the_span_for_random_overlapping_kernels():
    gen = torch.Generator().manual_seed(7)
    for _ in range(20):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        start = torch.rand(n, generator=gen) * 50
        end = start + torch.rand(n, generator=gen) * 10
        names = [f"k{int(i)}" for i in torch.randint(0, 5, (n,), generator=gen)]
        spans = list(zip(names, start.tolist(), end.tolist()))
        added, idle = kernel_profile.critical_path(spans)
        # the union of the intervals, measured independently
        union, cur_s, cur_e = 0.0, None, None
        for s, e in sorted(zip(start.tolist(), end.tolist())):
            if cur_e is None or s > cur_e:
                union += 0.0 if cur_e is None else cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        union += cur_e - cur_s
        assert sum(added.values()) == pytest.approx(union, abs=1e-9)
        assert idle == pytest.approx(end.max().item() - start.min().item() - union, abs=1e-9)
        assert all(v >= 0 for v in added.values())
