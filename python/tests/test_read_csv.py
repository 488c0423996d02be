"""nanguard.data.read_csv: values as the file has them, errors as Python users expect."""
import math

import pytest
import torch

from nanguard.data import read_csv


def test_reads_numbers_missing_values_and_quotes_in_parallel_pieces(tmp_path):
    rows = [[i * 0.5, -i / 3.0, float(i % 7)] for i in range(40000)]  # about 1 MB: several pieces
    lines = ["a;b;c"]
    for i, r in enumerate(rows):
        cells = ["%.17g" % v for v in r]
        if i % 1000 == 3:
            cells[1] = '"%s"' % cells[1]  # a quoted cell: the careful path
        if i % 1000 == 5:
            cells[2] = "NA"
            r[2] = math.nan
        lines.append(";".join(cells))
    path = tmp_path / "data.csv"
    path.write_text("\n".join(lines) + "\n")
    columns, data = read_csv(path, delimiter=";")
    assert columns == ["a", "b", "c"]
    assert data.dtype == torch.float64 and data.shape == (40000, 3)
    expect = torch.tensor(rows, dtype=torch.float64)
    assert torch.equal(data.isnan(), expect.isnan())
    assert torch.equal(data.nan_to_num(), expect.nan_to_num())


def test_errors_are_oserror_typeerror_and_valueerror_naming_the_line(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_csv(tmp_path / "missing.csv")
    path = tmp_path / "bad.csv"
    path.write_text("x,y\n1,2\n3,oops\n")
    with pytest.raises(ValueError, match=r"line 3, column 2 \('y'\): 'oops' is not a number"):
        read_csv(path)
    with pytest.raises(TypeError, match="delimiter must be one character"):
        read_csv(path, delimiter=",,")
    # The reader splits on one byte: 'é' was byte 0xE9, never found in a UTF-8 file ('1é2' is not a number).
    accented = tmp_path / "accented.csv"
    accented.write_text("a\u00e9b\n1\u00e92\n", encoding="utf-8")
    with pytest.raises(ValueError, match="delimiter must be an ASCII character .* but is 'é'"):
        read_csv(accented, delimiter="\u00e9")
