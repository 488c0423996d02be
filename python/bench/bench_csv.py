"""nanguard's CSV reader against pandas' and pyarrow's, on the same file in one run.

The file is data_bench's: 100k rows x 20 float64 columns of N(0, 1) written
with %.7g (about 20 MB). Each round reads it once with every reader, in a
rotated order; the ratios pair the reads of the same round. Prints
`key: value` lines:

    nanguard_mb_per_s, nanguard_one_thread_mb_per_s, pandas_mb_per_s,
    pyarrow_mb_per_s     best round
    csv_vs_pandas        median of pandas' time / nanguard's (95% interval)
    csv_one_thread_vs_pandas  the same with nanguard on one thread: speed per core
    csv_vs_pyarrow       the same against pyarrow (when it is installed)

pandas reads with its C engine, one thread, as a user calls it; pyarrow with
its default threads. nanguard and pyarrow use two threads (torch's and
pyarrow's setting); nanguard_one_thread one. On a busy machine the
two-thread reader gets more of the cores than one-thread pandas, which
flatters csv_vs_pandas; csv_one_thread_vs_pandas, one thread against one,
less so.
NANGUARD_BENCH_ROUNDS sets the rounds (default 15).
"""
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workload import paired_ratio, settings, timed_rounds  # noqa: E402

import nanguard.data  # noqa: E402

ROWS, COLS = 100_000, 20


def write_file(path):
    x = torch.randn(ROWS, COLS, dtype=torch.float64).tolist()
    with open(path, "w") as f:
        f.write(",".join(f"f{j}" for j in range(COLS)) + "\n")
        for row in x:
            f.write(",".join("%.7g" % v for v in row) + "\n")


def checked(name, read):
    """`read`, failing unless it read every row."""
    def run():
        rows = read()
        assert rows == ROWS, f"{name} read {rows} rows of {ROWS}"
    return run


def readers(path):
    """{name: read} of the readers installed."""
    import pandas

    def one_thread():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return nanguard.data.read_csv(path)[1].shape[0]
        finally:
            torch.set_num_threads(threads)

    out = {"nanguard": lambda: nanguard.data.read_csv(path)[1].shape[0],
           "nanguard_one_thread": one_thread,
           "pandas": lambda: len(pandas.read_csv(path, engine="c"))}
    try:
        import pyarrow
        import pyarrow.csv
        pyarrow.set_cpu_count(2)
        out["pyarrow"] = lambda: pyarrow.csv.read_csv(path).num_rows
    except ImportError:
        pass
    return {name: checked(name, read) for name, read in out.items()}


def main():
    rounds, _ = settings(15, 1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.csv")
        write_file(path)
        mb = os.path.getsize(path) / 1e6
        seconds, _ = timed_rounds(readers(path), rounds, 1)
    print(f"csv_file_mb: {mb:.1f}")
    for name, s in seconds.items():
        print(f"{name}_mb_per_s: {mb / min(s):.0f}")
    for other in ("pandas", "pyarrow"):
        if other in seconds:
            median, low, high = paired_ratio(seconds[other], seconds["nanguard"])
            print(f"csv_vs_{other}: {median:.2f} ({low:.2f}-{high:.2f})")
    median, low, high = paired_ratio(seconds["pandas"], seconds["nanguard_one_thread"])
    print(f"csv_one_thread_vs_pandas: {median:.2f} ({low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
