#!/usr/bin/env bash
# CLI test of `nanguard scan` and `nanguard clean`: exit codes, output, and
# the files written. Usage: data_cli_test.sh path/to/nanguard WORK_DIR
# (CLI_CASE=NAME runs one case)
set -u
source "$(dirname -- "${BASH_SOURCE[0]}")/check.sh"
NANGUARD=$(realpath -- "$1")
WORK=$2
[ -x "$NANGUARD" ] || { echo "FAIL: no nanguard binary at '$1'"; exit 1; }
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1

# A fixture: 400 rows, a constant column, missing values, an Inf, a missing
# label, and two far outliers in column b (rows 100 and 200).
{
  echo 'a,b,const,y'
  for i in $(seq 0 399); do
    a=$(( (i * 37) % 101 - 50 )); b=$(( (i * 53) % 97 ))
    case $i in
      10) a='' ;; 20) b='inf' ;; 30) a='NA' ;; 100|200) b=100000 ;;
    esac
    y=$(( i % 2 )); [ "$i" -eq 40 ] && y='nan'
    echo "$a,$b,7,$y"
  done
} > data.csv

# scan: the bad rows, the constant column, the outliers and the advice.
case_scan_reports() {
  run 3 "$NANGUARD" scan data.csv --label y
  expect 'data.csv: 400 rows x 4 columns (label: y)'
  expect 'rows with missing or non-finite values: 4 (rows 10, 20, 30, 40)'
  expect 'zero-variance columns: const'
  expect 'row 100'
  expect 'row 200'
  expect "column 'const' is constant (std = 0)"
  # Row 40 misses only its label: clean drops it, repair does not repair it (it said 4 rows).
  expect '3 rows hold missing or non-finite values (columns a, b)'
  expect 'nanguard clean data.csv -o clean.csv --policy repair'
}

# scan --json.
case_scan_json() {
  run 3 "$NANGUARD" scan data.csv --json
  expect '"rows": 400'
  expect '"zero_variance_columns": ['
  expect '"rows_with_nonfinite": 4'
  expect '"missing": 2'
  if command -v python3 >/dev/null; then
    python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["columns"][1]["pos_inf"] == 1, r; assert {t["row"] for t in r["isolation_forest"]["top_rows"][:2]} == {100, 200}, r' <<<"$out" \
      || fail "scan --json is not the expected JSON"
  fi
}

# clean --policy drop: the 4 bad rows go.
case_clean_drop() {
  run 0 "$NANGUARD" clean data.csv -o drop.csv --policy drop --label y
  expect 'wrote drop.csv: 400 -> 396 rows (policy drop)'
  expect 'dropped 4 rows (rows 10, 20, 30, 40)'
  [ "$(wc -l < drop.csv)" -eq 397 ] || fail "drop.csv should have a header and 396 rows"
}

# clean --policy repair: 3 values repaired, the row without a label dropped.
case_clean_repair() {
  run 0 "$NANGUARD" clean data.csv -o repair.csv --policy repair --label y
  expect 'wrote repair.csv: 400 -> 399 rows (policy repair)'
  expect 'repaired 3 values, clipped 0 values, in 3 rows (rows 10, 20, 30)'
  grep -qE '^,|,,|,$|inf|nan' repair.csv && fail "repair.csv still holds missing values"
  run 0 "$NANGUARD" scan repair.csv --label y
  expect 'rows with missing or non-finite values: 0'
}

# 2 outliers in 400 rows lie above P99.9 but not above P99.
case_clean_clip() {
  run 0 "$NANGUARD" clean data.csv -o clip.csv --policy clip --label y --high-quantile 0.99
  expect 'clipped'
  run 0 "$NANGUARD" scan clip.csv --json
  python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["columns"][1]["max"] < 1000, r["columns"][1]' <<<"$out" \
    || fail "clip.csv still holds the outliers of column b"
  # Written atomically: no temporary file is left next to the outputs.
  ls | grep -q '\.tmp\.' && fail "a temporary file was left behind: $(ls)"
}

# The counts are of the file written: row 0 is dropped for its missing label,
# so its low 'a' is not clipped (it said "clipped 2 values" of a file with 1).
case_clean_counts_what_it_writes() {
  printf 'a,y\n1,\n2,0\n3,1\n4,0\n5,1\n' > counts.csv
  run 0 "$NANGUARD" clean counts.csv -o counts_clip.csv --policy clip --label y
  expect 'wrote counts_clip.csv: 5 -> 4 rows (policy clip)'
  expect 'repaired 0 values, clipped 1 values, in 1 rows (rows 4)'
  expect 'a: missing=0 +inf=0 -inf=0 repaired=0 clipped=1'
}

# Column names come from the file: their control bytes are shown escaped,
# never sent to the terminal, and a long name is cut to 24 characters
# without splitting a UTF-8 one (x and 30 two-byte 'é': a cut at 24 bytes split the 12th).
case_scan_shows_column_names_safely() {
  long="x$(printf 'é%.0s' $(seq 30))"
  printf 'a\033[31mred,%s,c\n1,2,3\n1,5,7\n' "$long" > names.csv
  run 0 "$NANGUARD" scan names.csv
  grep -q $'\033' <<<"$out" && fail "an escape byte of a column name reached the terminal: $out"
  expect 'a\x1b[31mred'
  expect "column 'a\x1b[31mred' is constant"
  expect "x$(printf 'é%.0s' $(seq 23)) "
  python3 -c 'import sys; sys.stdin.buffer.read().decode("utf-8")' <<<"$out" \
    || fail "scan printed invalid UTF-8 (a cut inside a character): $out"
  run 2 "$NANGUARD" scan names.csv --label nope
  expect "its columns are: a\x1b[31mred, $long, c"
  grep -q $'\033' <<<"$out" && fail "an escape byte of a column name reached the terminal: $out"
}

# A name of wide (CJK) characters takes two columns a character: the table
# is as wide as it shows (padding by characters left the header 6 columns
# short of it), and a long one is cut at 24 columns, 12 such characters.
case_scan_aligns_wide_column_names() {
  printf '日本語の列名,c,%s\n1,2,3\n2,5,7\n' "$(printf '列%.0s' $(seq 15))" > wide.csv
  run 0 "$NANGUARD" scan wide.csv
  expect "$(printf 'column%18s  missing' '')"
  expect "$(printf '日本語の列名%12s        0' '')"
  expect "$(printf 'c%23s        0' '')"
  expect "$(printf '列%.0s' $(seq 12))$(printf '%8s' '')0"
  grep -qF "$(printf '列%.0s' $(seq 13))" <<<"$out" && fail "a wide name was not cut at 24 columns: $out"
  true
}

# Bad input: exit 2 and one line naming the problem.
case_bad_input() {
  run 2 "$NANGUARD" scan missing.csv
  expect "cannot open 'missing.csv': No such file or directory"
  : > empty.csv
  run 2 "$NANGUARD" scan empty.csv
  expect "'empty.csv' is empty"
  printf 'a,b\n1,2\n3\n' > ragged.csv
  run 2 "$NANGUARD" clean ragged.csv -o out.csv --policy drop
  expect "'ragged.csv' line 3 has 1 field but the header has 2 columns"
  [ -e out.csv ] && fail "clean wrote out.csv from a bad input"
  printf 'a,b\n1,2\n3,hello\n' > text.csv
  run 2 "$NANGUARD" scan text.csv
  expect "'text.csv' line 3, column 2 ('b'): 'hello' is not a number"
  run 2 "$NANGUARD" scan data.csv --label nope
  expect "no column 'nope' in 'data.csv'; its columns are: a, b, const, y"
  run 2 "$NANGUARD" clean data.csv -o x.csv --policy sometimes
  run 2 "$NANGUARD" clean data.csv -o /nonexistent/dir/x.csv --policy drop
  expect 'check that the directory exists and is writable'
  mkdir -p out_dir
  run 2 "$NANGUARD" clean data.csv -o out_dir --policy drop
  expect "'out_dir' is a directory; name the file to write in it, e.g. 'out_dir/clean.csv'"
  run 2 "$NANGUARD" clean data.csv -o '' --policy drop
  expect 'the output path is empty'
  ls | grep -q '\.tmp\.' && fail "a temporary file was left behind: $(ls)"
}

run_cases scan_reports \
  scan_json \
  clean_drop \
  clean_repair \
  clean_clip \
  clean_counts_what_it_writes \
  scan_shows_column_names_safely \
  scan_aligns_wide_column_names \
  bad_input

[ "$failures" -eq 0 ] && echo "data CLI: all checks passed"
exit $(( failures > 0 ))
