#!/usr/bin/env bash
# CLI test of `nanguard census` on tensors saved with torch.save: float,
# complex, integer and bool data, exit codes and what it prints.
# Usage: census_cli_test.sh path/to/nanguard PYTHON WORK_DIR  (CLI_CASE=NAME runs one case)
set -u
source "$(dirname -- "${BASH_SOURCE[0]}")/check.sh"
NANGUARD=$(realpath -- "$1")
PYTHON=$2
WORK=$3
[ -x "$NANGUARD" ] || { echo "FAIL: no nanguard binary at '$1'"; exit 1; }
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1

"$PYTHON" - <<'PY' || fail "could not write the test tensors with $PYTHON"
import torch
torch.save(torch.tensor([1.0, 2.0, 3.0]), "finite.pt")
torch.save(torch.tensor([1.0, float("nan"), float("inf")]), "nan.pt")
torch.save(torch.tensor([1 + 1j, complex(0.0, float("nan"))]), "complex_nan.pt")
torch.save(torch.tensor([1 + 1j, 2 - 1j]), "complex.pt")
torch.save(torch.arange(4), "int.pt")
torch.save(torch.tensor([True, False]), "bool.pt")
torch.save(torch.eye(3).to_sparse(), "sparse.pt")
torch.save(torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn), "float8.pt")
PY

# Finite float and complex data; integer and bool data are always finite.
case_finite_and_always_finite_types() {
  run 0 "$NANGUARD" census finite.pt int.pt bool.pt complex.pt
  expect 'int.pt: [4] Long tensor: integer data is always finite'
  expect 'bool.pt: [2] Bool tensor: bool data is always finite'
  expect 'complex.pt: [2] ComplexFloat'
  expect 'n=4 nan=0'
}

# A NaN in a complex tensor's imaginary part: exit 3.
case_complex_nan() {
  run 3 "$NANGUARD" census complex_nan.pt
  expect 'n=4 nan=1'
}

# Several files, one with a NaN and an Inf: exit 3.
case_nan_and_inf() {
  run 3 "$NANGUARD" census finite.pt nan.pt
  expect 'nan=1 +inf=1'
}

# Tensors LibTorch cannot load: what they are and what to save instead (#41).
case_tensors_libtorch_cannot_load() {
  run 2 "$NANGUARD" census sparse.pt
  expect "'sparse.pt' holds a sparse tensor (or another non-strided layout), which LibTorch cannot load; save t.to_dense()"
  run 2 "$NANGUARD" census float8.pt
  expect "'float8.pt' holds a tensor of a dtype LibTorch cannot load (float8, uint16, ...); save t.float()"
}

run_cases finite_and_always_finite_types complex_nan nan_and_inf tensors_libtorch_cannot_load

exit $(( failures > 0 ))
