"""The benchmarks' interleaved timer (attnprep._bench.median_ms_interleaved):
every contender's calls are made, rotated over its list, and each median
belongs to its own contender."""

from attnprep import _bench as common
from conftest import requires_cuda


@requires_cuda
def test_interleaved_times_each_contender_over_its_whole_list():
    import torch

    calls = {}

    def recorder(name, cycles):
        def call():
            calls[name] = calls.get(name, 0) + 1
            torch.cuda._sleep(cycles)

        return call

    # Spins of very different lengths: each median must come from its own contender.
    short = [recorder(("short", i), 1_000) for i in range(3)]
    long = [recorder(("long", i), 400_000) for i in range(2)]
    middle = [recorder(("middle", 0), 100_000)]
    t_short, t_long, t_middle = common.median_ms_interleaved([short, long, middle], iters=12, warmup=2)
    assert t_short < t_middle < t_long
    assert t_long > 10 * t_short
    # warm-up calls plus one timed call per round, spread over every entry of each list
    assert sum(v for (name, _), v in calls.items() if name == "short") == 2 + 12
    assert sum(v for (name, _), v in calls.items() if name == "long") == 2 + 12
    assert calls[("middle", 0)] == 2 + 12
    assert all(calls.get(("short", i), 0) >= 1 for i in range(3))
    assert all(calls.get(("long", i), 0) >= 1 for i in range(2))
