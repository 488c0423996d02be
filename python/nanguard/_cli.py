"""The ``nanguard`` command from the Python package: the C++ CLI that the
package carries (``nanguard/bin/nanguard``), run by the console script
``nanguard``, ``python -m nanguard`` and :func:`nanguard.report` /
:func:`nanguard.inspect`.

The command links torch's LibTorch: it runs with the lib folder of the torch
of this Python on ``LD_LIBRARY_PATH`` (found without importing torch), so it
works wherever pip put torch.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings
from typing import Dict, NoReturn, Optional, Sequence, Union

from ._args import optional, path, sequence_of, text

PathLike = Union[str, "os.PathLike[str]"]
#: How the command begins a warning on its standard error.
WARNING = "nanguard: warning: "


def executable() -> str:
    """The path of the ``nanguard`` command: ``$NANGUARD_CLI`` when set, else
    the one in the package.

    Raises:
        FileNotFoundError: the package holds no command (a build configured
            with ``-DNANGUARD_BUILD_CLI=OFF``).
    """
    path = os.environ.get("NANGUARD_CLI") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin",
                                                          "nanguard")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"nanguard: the nanguard command is not at {path}; `pip install .` installs it "
                                "with the package (a build with -DNANGUARD_BUILD_CLI=OFF has none), or set "
                                "NANGUARD_CLI to a built one (build/tools/cli/nanguard)")
    return path


def environment() -> Dict[str, str]:
    """This process's environment with torch's lib folder first on
    ``LD_LIBRARY_PATH``: the command links LibTorch."""
    env = dict(os.environ)
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        lib = os.path.join(list(spec.submodule_search_locations)[0], "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Runs the ``nanguard`` command with ``argv`` (default: this process's
    arguments) in place of this process: the console script and
    ``python -m nanguard``."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        exe = executable()
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    sys.stdout.flush()
    os.execve(exe, [exe, *args], environment())


def run(args: Sequence[str], what: str) -> str:
    """The standard output of ``nanguard ARGS``; each warning the command
    printed (``nanguard: warning: ...`` on its standard error) is raised as a
    Python ``UserWarning``.

    Raises:
        ValueError: the command refused its input (exit 2: a missing,
            malformed or unreadable file); the message is the command's.
        RuntimeError: it failed otherwise.
    """
    done = subprocess.run([executable(), *args], env=environment(), capture_output=True, text=True)
    if done.returncode != 0:
        message = (done.stderr.strip() or done.stdout.strip()).removeprefix("nanguard: error: ")
        error = ValueError if done.returncode == 2 else RuntimeError
        raise error(f"nanguard.{what}: {message}")
    for line in done.stderr.splitlines():
        if line.startswith(WARNING):
            warnings.warn(f"nanguard.{what}: {line.removeprefix(WARNING)}", UserWarning, stacklevel=3)
    return done.stdout


def report(events: Union[PathLike, Sequence[PathLike]], out_html: PathLike, *, title: Optional[str] = None,
           tensorboard: Optional[PathLike] = None) -> str:
    """Writes the HTML report of one or more runs' event logs, as
    ``nanguard report`` does.

    Args:
        events: a JSONL event log (``Guard(event_log=...)``, ``nanguard
            train``), or a list of them (one run each, compared on one page).
        out_html: the HTML file to write (self-contained).
        title: the page's title (default "nanguard report").
        tensorboard: also write the runs as TensorBoard event files there.

    Returns:
        ``out_html``, as a string.

    Raises:
        FileNotFoundError: an event log does not exist.
        ValueError: an event log is malformed (the message names the file
            and line), no log holds an event, or ``out_html`` is one of
            the logs.

    Warns:
        UserWarning: one of several logs holds no event (the page shows it
            as an empty run).
    """
    where = "nanguard.report"
    logs = [path(where, "events", events)] if isinstance(events, (str, os.PathLike)) else \
        sequence_of(path, where, "events", events, "an event log's path or a list of them")
    out_html = path(where, "out_html", out_html)
    title = optional(text, where, "title", title)
    tensorboard = optional(path, where, "tensorboard", tensorboard)
    for log in logs:
        if not os.path.exists(log):
            raise FileNotFoundError(f"nanguard.report: no event log at {log}")
    args = ["report", "-o", out_html]
    if title is not None:
        args += ["--title", title]
    if tensorboard is not None:
        args += ["--tensorboard", tensorboard]
    run([*args, "--", *logs], "report")  # "--": a log named "-run.jsonl" is not an option
    return out_html


def inspect(bundle: PathLike) -> str:
    """What a repro bundle holds (``Guard(policy="abort", bundle_dir=...)``
    writes one), as ``nanguard inspect`` prints it: step, finding, tensors
    and their census.

    Args:
        bundle: the bundle's directory (``StepResult.bundle``).

    Returns:
        The text ``nanguard inspect`` prints.

    Raises:
        FileNotFoundError: ``bundle`` does not exist.
        ValueError: it is not a readable bundle.
    """
    bundle = path("nanguard.inspect", "bundle", bundle)
    if not os.path.exists(bundle):
        raise FileNotFoundError(f"nanguard.inspect: no bundle at {bundle}")
    return run(["inspect", "--", bundle], "inspect")  # "--": a bundle named "-b" is not an option
