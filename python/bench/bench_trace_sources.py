#!/usr/bin/env python3
"""What recording the forward ops' call stacks costs nanguard.trace
(tracer_options::record_sources: a backward finding names the user's line
of its forward op), on bench_overhead.py's reference workload.

Three variants measured interleaved round-robin on one model: plain, the
trace as it ships (sources recorded), and the trace with the recording
off. Prints `trace_ratio`, `trace_without_sources_ratio` (each against
plain) and `sources_cost_ratio` (the trace against itself without the
recording), each with `_ci95`. Environment: as bench_overhead.py.
"""
import sys

from nanguard import _nanguard, _trace
from workload import paired_ratio, settings, step_variants, timed_rounds, training


def without_sources(trace):
    """``trace`` run with the tracer's record_sources off."""
    def run():
        made = _trace._nanguard.Tracer
        _trace._nanguard.Tracer = lambda *args, **kwargs: made(*args, **{**kwargs, "record_sources": False})
        try:
            trace()
        finally:
            _trace._nanguard.Tracer = made
    return run


def main():
    rounds, steps = settings(rounds=30, steps=2)
    variants, _ = step_variants(*training())
    measured = {"plain": variants["plain"], "trace": variants["trace"],
                "trace_without_sources": without_sources(variants["trace"])}
    for fn in measured.values():  # warm-up
        fn()
    times, _ = timed_rounds(measured, rounds, steps)
    pairs = {"trace_ratio": ("trace", "plain"), "trace_without_sources_ratio": ("trace_without_sources", "plain"),
             "sources_cost_ratio": ("trace", "trace_without_sources")}
    for key, (a, b) in pairs.items():
        ratio, low, high = paired_ratio(times[a], times[b])
        print(f"{key}: {ratio:.3f}")
        print(f"{key}_ci95: {low:.3f}..{high:.3f}")
    return 0


if __name__ == "__main__":
    assert _nanguard.Tracer is _trace._nanguard.Tracer
    sys.exit(main())
