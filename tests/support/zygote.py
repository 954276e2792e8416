"""Run many short Python scripts, each in a fresh process, without paying for torch's import
in each: one process imports the heavy modules once and forks a child per script.

::

    with Zygote(["torch", "shardserve.client"]) as z:
        done = z.run(Path("page.py"), cwd=tmp, env=os.environ, timeout=60)
        assert done.returncode == 0, done.stderr

A child is a new process, as ``python page.py`` would be: its own ``__main__``, working
directory, environment, file descriptors and module state (a singleton one script sets up is
gone for the next). What it shares is what the parent imported before forking, which does
nothing but import, so no thread or thread pool is running at the fork. A script that does
not finish within ``timeout`` is killed with its parent, and the error says which.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
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
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
            cwd=ROOT,
        )  # fmt: skip

    def run(self, script: Path, cwd: Path, env: Mapping[str, str], timeout: float) -> Done:
        """Run ``script`` as ``python script`` would in ``cwd`` with ``env``; wait at most
        ``timeout`` seconds for it."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        out, err = cwd / f".{script.name}.stdout", cwd / f".{script.name}.stderr"
        request = {"script": str(script), "cwd": str(cwd), "env": dict(env),
                   "stdout": str(out), "stderr": str(err)}  # fmt: skip
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout)
        if not ready:
            self.close()
            raise TimeoutError(f"{script} did not finish within {timeout:.0f} s (killed)")
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote died running {script} (exit {self._proc.wait()})")
        return Done(json.loads(line)["returncode"], out.read_text(), err.read_text())

    def close(self) -> None:
        """Kill the zygote and any child still running."""
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.close()


def _child(request: dict[str, str | dict[str, str]]) -> int:
    """In the forked child: become ``python script`` and run it; its exit code."""
    import runpy
    import traceback

    env = request["env"]
    assert isinstance(env, dict)
    os.chdir(str(request["cwd"]))
    os.environ.clear()
    os.environ.update(env)
    # The zygote's stdin and stdout are its requests and replies: not the script's.
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the script's stdin for its whole life
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    script = str(request["script"])
    sys.argv = [script]
    sys.path[0] = str(Path(script).resolve().parent)
    try:
        runpy.run_path(script, run_name="__main__")
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
