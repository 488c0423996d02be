"""The python_wheel test: the package as a pip user gets it.

1. A copy of the source tree (the files git tracks or would track) is built
   into a wheel with `pip wheel`, by the python of a scratch virtual
   environment that sees the torch (and scikit-build-core) of this one
   through a .pth file; nothing is fetched. The copy must be left as it
   was: the build happens outside the source tree. It is compiled
   unoptimised (-O0 in place of Release's -O3, the one change to what
   `pip install .` does): what this test checks is the packaging, the
   build's own tests check the optimised code, and -O0 halves the
   compile, the longest part of the test suite.
2. The wheel is installed into that environment, and from another folder,
   with nothing on PYTHONPATH: the console script `nanguard --version`,
   `python -m nanguard --version`, check_installed.py (imports from the
   install, a trace), a Python Guard that writes an event log and, on abort,
   a bundle; `nanguard report` on the log and `nanguard inspect` on the
   bundle, through the command and through nanguard.report / nanguard.inspect.
3. With CUDA, the installed extension carries code for every configured
   architecture (tests/cuda_architectures_test.py on it).

Usage: wheel_test.py SOURCE_DIR WORK_DIR --with-cuda ON|OFF --default-architectures LIST
(LIST: cmake/cuda.cmake's default, comma-separated; the wheel is built for
it, or for $NANGUARD_CUDA_ARCHITECTURES when set)
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

GUARDED_RUN = r"""
import sys, torch, torch.nn.functional as F, nanguard
log, bundles = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
guard = nanguard.Guard(model, opt, policy="abort", event_log=log, bundle_dir=bundles)
x, y = torch.randn(8, 4), torch.randn(8, 1)
guard.step(lambda a, b: F.mse_loss(model(a), b), x, y)
try:
    guard.step(lambda a, b: F.mse_loss(model(a).log(), b), x, y)
except nanguard.NonFiniteError as e:
    print(e.result.bundle)
    print(nanguard.inspect(e.result.bundle))
    print(nanguard.report(log, log + ".api.html"))
"""


def run(cmd, **kwargs):
    """Runs ``cmd``; its output on failure, then exits."""
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, text=True, capture_output=True, **kwargs)
    if done.returncode != 0:
        sys.exit(f"wheel_test: {' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def source_files(source):
    """The files of the source tree that git tracks or would track (no build outputs)."""
    out = subprocess.run(["git", "-C", source, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, capture_output=True).stdout
    return sorted(f for f in out.decode().split("\0") if f and os.path.isfile(os.path.join(source, f)))


def tree(root):
    """Every file and folder under ``root``, with the size and mtime of each file."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(folder, d), root) + "/"] = None
        for f in files:
            st = os.stat(os.path.join(folder, f))
            out[os.path.relpath(os.path.join(folder, f), root)] = (st.st_size, st.st_mtime_ns)
    return out


def copy_source(source, dest):
    for f in source_files(source):
        os.makedirs(os.path.dirname(os.path.join(dest, f)), exist_ok=True)
        shutil.copy2(os.path.join(source, f), os.path.join(dest, f))


def scratch_venv(venv):
    """A virtual environment whose site-packages sees this Python's (torch,
    scikit-build-core) through a .pth file; returns its python."""
    base = getattr(sys, "_base_executable", sys.executable)
    run([base, "-m", "venv", venv])
    python = os.path.join(venv, "bin", "python")
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    import torch  # noqa: F401  (where this Python's torch is)
    torch_site = os.path.dirname(os.path.dirname(sys.modules["torch"].__file__))
    with open(os.path.join(site, "torch_env.pth"), "w") as f:
        f.write(torch_site + "\n")
    return python, site


def build_environment():
    """The environment of the wheel build: no PYTHONPATH, ccache when there is one
    (CCACHE_BASEDIR=/ so that the random temporary build folder still hits)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NANGUARD_CLI")}
    if shutil.which("ccache"):
        env.update(CMAKE_CXX_COMPILER_LAUNCHER="ccache", CMAKE_CUDA_COMPILER_LAUNCHER="ccache", CCACHE_BASEDIR="/")
        env.setdefault("CCACHE_SLOPPINESS", "pch_defines,time_macros,include_file_mtime,include_file_ctime,locale")
    return env


def check_cli(venv, python, site, work, env):
    """The command and the Python API on a log and a bundle a Python Guard wrote."""
    nanguard = os.path.join(venv, "bin", "nanguard")
    version = run([nanguard, "--version"], env=env, cwd=work).strip()
    module_version = run([python, "-c", "import nanguard; print(nanguard.__version__)"], env=env, cwd=work).strip()
    assert version == f"nanguard {module_version}", (version, module_version)
    assert run([python, "-m", "nanguard", "--version"], env=env, cwd=work).strip() == version
    print(run([python, os.path.join(HERE, "check_installed.py"), site], env=env, cwd=work))

    log, bundles = os.path.join(work, "events.jsonl"), os.path.join(work, "bundles")
    out = run([python, "-c", GUARDED_RUN, log, bundles], env=env, cwd=work)
    bundle = out.splitlines()[0]
    assert os.path.isdir(bundle) and bundle.startswith(bundles), out
    assert "aten::log" in out and out.rstrip().endswith(log + ".api.html"), out
    run([nanguard, "report", log, "-o", os.path.join(work, "report.html")], env=env, cwd=work)
    with open(os.path.join(work, "report.html"), encoding="utf-8") as f:
        page = f.read()
    assert page.lstrip().lower().startswith("<!doctype html") and "aten::log" in page, page[:200]
    shown = run([nanguard, "inspect", bundle], env=env, cwd=work)
    assert "aten::log" in shown, shown
    print(f"nanguard --version: {version}; report and inspect read the Python Guard's log and bundle")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("source")
    p.add_argument("work")
    p.add_argument("--with-cuda", default="OFF")
    p.add_argument("--default-architectures", default="")
    a = p.parse_args()

    shutil.rmtree(a.work, ignore_errors=True)
    src, venv, dist, work = (os.path.join(a.work, d) for d in ("src", "venv", "dist", "run"))
    os.makedirs(work)
    copy_source(a.source, src)
    before = tree(src)
    python, site = scratch_venv(venv)
    env = build_environment()

    start = time.monotonic()
    run([python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--config-settings=cmake.define.CMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG", "-w", dist, src], env=env)
    print(f"wheel built in {time.monotonic() - start:.0f} s", flush=True)
    after = tree(src)
    changed = sorted(k for k in set(before) | set(after) if before.get(k, "-") != after.get(k, "-"))
    assert not changed, f"building the wheel changed the source tree: {changed[:20]}"

    wheel = [os.path.join(dist, w) for w in os.listdir(dist) if w.endswith(".whl")]
    assert len(wheel) == 1, os.listdir(dist)
    run([python, "-m", "pip", "install", "--no-deps", "--no-index", wheel[0]], env=env)
    check_cli(venv, python, site, work, env)

    if a.with_cuda.upper() in ("ON", "TRUE", "1"):
        extension = run([python, "-c", "import nanguard; print(nanguard._nanguard.__file__)"], env=env, cwd=work)
        built_for = os.environ.get("NANGUARD_CUDA_ARCHITECTURES", a.default_architectures).replace(";", ",")
        print(run([sys.executable, os.path.join(HERE, "..", "..", "..", "tests", "cuda_architectures_test.py"),
                   "--default", a.default_architectures, "--configured", built_for, "--with-cuda", "ON",
                   "--library", extension.strip()]))
    print("python_wheel: passed")


if __name__ == "__main__":
    main()
