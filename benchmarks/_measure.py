"""Shared benchmark plumbing: run commands in fresh processes, time them, read their peak RSS.

Every measurement is a new process, so its peak RSS is its own. Python children built with
:func:`python_argv` print one JSON line (timings they took themselves plus their own
``ru_maxrss``) which :func:`run` parses into :attr:`Run.report`; for any other command the
peak RSS comes from ``os.wait4`` on the child.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = REPO_ROOT / "benchmarks" / "out"
REPORT_MARKER = "@@bench@@ "

#: Prepended to every instrumented child: ``_report(**values)`` prints the JSON result line
#: with the child's own peak RSS (Linux ``ru_maxrss`` is in KiB) read at that moment.
_CHILD_PRELUDE = f"""\
import json as _json, resource as _resource, sys, time
def _report(**values):
    values["maxrss_kib"] = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss
    print({REPORT_MARKER!r} + _json.dumps(values), flush=True)
"""


@dataclass
class Run:
    """One finished child process: outer wall time, peak RSS, output and its JSON report."""

    argv: list[str]
    wall_s: float
    wait4_maxrss_kib: int
    cpu_s: float  # user + system CPU time of the whole child, from wait4
    returncode: int
    stdout: str
    stderr: str
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_rss_mib(self) -> float:
        """Peak RSS in MiB: the child's own reading if it reported one, else ``wait4``'s."""
        return self.report.get("maxrss_kib", self.wait4_maxrss_kib) / 1024


def child_env(**overrides: str | None) -> dict[str, str]:
    """This process's environment with the repo root on PYTHONPATH; ``None`` drops a variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_PROCESS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def python_argv(code: str, *, block_torch: bool = False) -> list[str]:
    """``python -c`` argv running ``code`` after the prelude that defines ``_report``.

    ``block_torch`` first sets ``sys.modules["torch"] = None`` so any import of torch fails.
    """
    block = 'sys.modules["torch"] = None\n' if block_torch else ""
    return [sys.executable, "-c", _CHILD_PRELUDE + block + textwrap.dedent(code)]


def run(argv: Sequence[str], *, env: dict[str, str] | None = None, check: bool = True) -> Run:
    """Run ``argv`` in a fresh process from the repo root and measure wall time and peak RSS."""
    argv = list(argv)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=child_env() if env is None else env,
            cwd=REPO_ROOT,
        )
        _, status, usage = os.wait4(proc.pid, 0)  # reaps it: rusage of this one child
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    report: dict[str, Any] = {}
    for line in stdout.splitlines():
        if line.startswith(REPORT_MARKER):
            report = json.loads(line[len(REPORT_MARKER) :])
    cpu = usage.ru_utime + usage.ru_stime
    result = Run(argv, wall, usage.ru_maxrss, cpu, proc.returncode, stdout, stderr, report)
    if check and result.returncode != 0:
        raise RuntimeError(
            f"benchmark child failed (exit {result.returncode}): {_short(argv)}\n{stderr[-3000:]}"
        )
    return result


def repeat_interleaved(
    jobs: dict[str, Callable[[], Run]],
    repeat: int,
    *,
    warmup: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, list[Run]]:
    """Run every job ``repeat`` times round-robin (so load from other users spreads evenly)."""
    log = log or progress
    if warmup:
        for name, job in jobs.items():
            log(f"warm-up: {name}")
            job()
    runs: dict[str, list[Run]] = {name: [] for name in jobs}
    for round_no in range(1, repeat + 1):
        for name, job in jobs.items():
            result = job()
            runs[name].append(result)
            log(f"round {round_no}/{repeat}: {name}: {result.wall_s:.2f} s wall")
    return runs


def median(values: Sequence[float]) -> float:
    """The median of ``values``."""
    return float(statistics.median(values))


def ratio(value: float, anchor: float) -> str:
    """``value / anchor`` formatted as ``0.12x``."""
    return f"{value / anchor:.3g}x" if anchor else "n/a"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table with right-aligned cells after the first column."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        return "| " + " | ".join(parts) + " |"

    rule = "|" + "|".join(["-" * (widths[0] + 2)] + ["-" * (w + 1) + ":" for w in widths[1:]])
    return "\n".join([line(cells[0]), rule + "|"] + [line(row) for row in cells[1:]])


def environment() -> dict[str, Any]:
    """Machine facts worth keeping next to timings (load average shows competing jobs)."""
    return {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def load_line(before: dict[str, Any]) -> str:
    """How busy the machine was: 1-minute load average at the start and now."""
    return (
        f"Load average (1 min) at start / end: {before['loadavg'][0]:.2f} / "
        f"{os.getloadavg()[0]:.2f} on {before['cpus']} CPUs (other jobs share this machine)."
    )


def runs_json(runs: Mapping[str, Sequence[Run]]) -> dict[str, list[dict[str, Any]]]:
    """Every individual run, for the JSON file: the child's outer wall and CPU time, its peak
    RSS and what it reported itself."""
    return {
        name: [
            {
                "process_wall_s": r.wall_s,
                "process_cpu_s": r.cpu_s,
                "peak_rss_mib": r.peak_rss_mib,
                **r.report,
            }
            for r in results
        ]
        for name, results in runs.items()
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, creating the parent directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def cached_input(directory: Path, params: dict[str, Any], generate: str, what: str) -> Path:
    """``directory``, generated once by a child process running ``generate`` (Python code that
    fills the directory named by the variable ``out``, with ``benchmarks/`` importable), and
    again only when ``params`` change. Built under a temporary name and renamed, so an
    interrupted run never leaves a half-written input behind."""
    stamp = directory / "params.json"
    if stamp.exists() and json.loads(stamp.read_text()) == params:
        return directory
    tmp = directory.with_name(directory.name + ".tmp")
    for stale in (directory, tmp):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    progress(f"generating {directory.name}: {what} (once; cached)")
    start = time.perf_counter()
    prelude = (
        f"from pathlib import Path\nsys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
    )
    run(python_argv(prelude + f"out = Path({str(tmp)!r})\n" + textwrap.dedent(generate)))
    (tmp / "params.json").write_text(json.dumps(params))
    os.replace(tmp, directory)
    progress(f"generated in {time.perf_counter() - start:.1f} s")
    return directory


def progress(message: str) -> None:
    """A progress line on stderr (stdout carries the results)."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _short(argv: Sequence[str]) -> str:
    text = " ".join(argv)
    return text if len(text) < 200 else text[:200] + "…"
