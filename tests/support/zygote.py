"""Run many short Python scripts, each in a fresh process, without paying for torch's import
in each: one process imports the heavy modules once and forks a child per script.

::

    with Zygote(["torch", "shardserve.client"]) as z:
        done = z.run(["page.py"], cwd=tmp, env=os.environ, timeout=60)    # python page.py
        assert done.returncode == 0, done.stderr
        z.run(["-m", "tests.worker", "--out", "x"], cwd=ROOT, env=os.environ, timeout=60)

A child is a new process, as ``python ARGS`` would be: its own ``__main__``, working
directory, environment, file descriptors and module state (a singleton one script sets up is
gone for the next). What it shares is what the parent imported before forking, which does
nothing but import, so no thread or thread pool is running at the fork. A script that does
not finish within ``timeout`` is killed with its parent, and the error says which.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Done:
    """A finished script: its exit code and what it printed."""

    returncode: int
    stdout: str
    stderr: str


class Zygote:
    """A process that imported ``preload`` and forks one child per :meth:`run`."""

    def __init__(self, preload: Sequence[str]) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd=ROOT,
        )
        self._outputs = Path(tempfile.mkdtemp(prefix="zygote-"))
        self._runs = 0

    def run(self, args: Sequence[str], cwd: Path, env: Mapping[str, str], timeout: float) -> Done:
        """Run ``python *args`` (a script and its arguments, or ``-m module ...``) in ``cwd``
        with ``env``; wait at most ``timeout`` seconds for it."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        if self._proc.poll() is not None:
            raise RuntimeError(
                f"cannot run python {' '.join(args)}: the zygote has ended "
                f"(exit {self._proc.returncode}; an earlier script timed out?)"
            )
        self._runs += 1
        out, err = (self._outputs / f"{self._runs}.{n}" for n in ("stdout", "stderr"))
        request = {
            "args": list(args),
            "cwd": str(cwd),
            "env": dict(env),
            "stdout": str(out),
            "stderr": str(err),
        }
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout)
        if not ready:
            self.close()
            raise TimeoutError(
                f"python {' '.join(args)} did not finish within {timeout:.0f} s (killed)"
            )
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"the zygote died running python {' '.join(args)} (exit {self._proc.wait()})"
            )
        return Done(json.loads(line)["returncode"], out.read_text(), err.read_text())

    def close(self) -> None:
        """Kill the zygote and any child still running."""
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()
        shutil.rmtree(self._outputs, ignore_errors=True)

    def __enter__(self) -> Zygote:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _child(request: dict[str, str | list[str] | dict[str, str]]) -> int:
    """In the forked child: become ``python ARGS`` and run them; its exit code."""
    import runpy
    import traceback

    env, args, cwd = request["env"], request["args"], str(request["cwd"])
    assert isinstance(env, dict) and isinstance(args, list)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # The zygote's stdin and stdout are its requests and replies: not the script's.
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the script's stdin for its whole life
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    try:
        if args[0] == "-m":  # python -m: the module's file as argv[0], the cwd first on the path
            sys.argv, sys.path[0] = ["-m", *args[2:]], cwd
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = list(args), str(Path(args[0]).resolve().parent)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _serve(preload: Sequence[str]) -> None:
    import importlib

    for name in preload:
        importlib.import_module(name)
    replies = sys.stdout
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(json.loads(line))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve(sys.argv[1:])
