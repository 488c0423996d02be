"""The CUDA kernels' architectures (cmake/cuda.cmake), run by CTest's
cuda_architectures test:

- the default list holds real code for every architecture torch's wheel
  runs on that the issue names (80 86 89 90 100 120) and PTX for the newest;
- in a CUDA build, the library carries code for each configured
  architecture: `cuobjdump --list-elf` lists an sm_XX cubin for each real
  one and `--list-ptx` an sm_XX PTX for each virtual one.

Usage: cuda_architectures_test.py --default LIST --configured LIST
       --with-cuda ON|OFF --library PATH   (LISTs: CUDA_ARCHITECTURES
       entries separated by commas, e.g. 80-real,90)
"""
import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys

REQUIRED_REAL = {80, 86, 89, 90, 100, 120}


def code_of(architectures):
    """(real, virtual): the sm_ and compute_ numbers of a CUDA_ARCHITECTURES
    list ("90" is both, "90-real" real code only, "90-virtual" PTX only)."""
    real, virtual = set(), set()
    for entry in filter(None, architectures.split(",")):
        m = re.fullmatch(r"(\d+)a?(?:-(real|virtual))?", entry.strip())
        if not m:
            sys.exit(f"cuda_architectures: cannot read the architecture {entry!r}")
        number, kind = int(m.group(1)), m.group(2)
        if kind != "virtual":
            real.add(number)
        if kind != "real":
            virtual.add(number)
    return real, virtual


def cuobjdump():
    """cuobjdump: on PATH, in the CUDA toolkit, or from the nvidia-cuda-cuobjdump package."""
    found = shutil.which("cuobjdump") or ("/usr/local/cuda/bin/cuobjdump"
                                          if os.access("/usr/local/cuda/bin/cuobjdump", os.X_OK) else None)
    spec = importlib.util.find_spec("nvidia")
    for root in ([] if found or spec is None else list(spec.submodule_search_locations or [])):
        for sub in ("cu13/bin", "cuda_cuobjdump/bin"):
            path = os.path.join(root, sub, "cuobjdump")
            if os.access(path, os.X_OK):
                return path
    if not found:
        sys.exit("cuda_architectures: no cuobjdump (scripts/setup-python installs nvidia-cuda-cuobjdump, "
                 "python/requirements-tools.txt)")
    return found


def listed(tool, flag, library, suffix):
    """The architecture numbers `cuobjdump FLAG LIBRARY` lists: its lines
    name files such as census_cuda.cu.1.sm_90.cubin (or .ptx)."""
    out = subprocess.run([tool, flag, library], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"cuda_architectures: {tool} {flag} {library} failed: {out.stderr.strip()}")
    return {int(n) for n in re.findall(rf"\.sm_(\d+)[af]?\.{suffix}\b", out.stdout)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--default", required=True)
    p.add_argument("--configured", required=True)
    p.add_argument("--with-cuda", required=True)
    p.add_argument("--library", required=True)
    a = p.parse_args()

    real, virtual = code_of(a.default)
    missing = REQUIRED_REAL - real
    assert not missing, f"the default architectures {a.default} carry no real code for {sorted(missing)}"
    assert virtual and max(virtual) >= max(real), \
        f"the default architectures {a.default} carry no PTX for the newest ({max(real)})"
    print(f"default: sm {sorted(real)}, PTX {sorted(virtual)}")

    if a.with_cuda.upper() not in ("ON", "TRUE", "1"):
        print("no CUDA build here: the library's code is not checked")
        return
    tool = cuobjdump()
    want_real, want_virtual = code_of(a.configured)
    elf = listed(tool, "--list-elf", a.library, "cubin")
    ptx = listed(tool, "--list-ptx", a.library, "ptx") if want_virtual else set()
    assert want_real <= elf, f"{a.library} carries cubins for sm {sorted(elf)}, not for {sorted(want_real - elf)}"
    assert want_virtual <= ptx, f"{a.library} carries PTX for {sorted(ptx)}, not for {sorted(want_virtual - ptx)}"
    print(f"{a.library}: cubins sm {sorted(elf)}, PTX {sorted(ptx)} ({tool})")


if __name__ == "__main__":
    main()
