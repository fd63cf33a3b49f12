"""Python subprocesses that the cross-process tests start: in the repository
root, on CPU devices only, each in its own process group."""

import os
import signal
import subprocess
import sys
from pathlib import Path

# The repository root: the subprocesses' working directory.
ROOT = Path(__file__).resolve().parents[2]


def start_process(args, cwd, **env):
    """`python ARGS` on CPU devices only, in its own process group (so that
    everything it starts can be stopped together), its output captured. `env`
    changes this process's environment; a `None` removes a variable."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu", **env}
    return subprocess.Popen(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        env={k: v for k, v in env.items() if v is not None},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def stop_process(process):
    """Kill a process started by `start_process` and everything it started."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.communicate()


def finish_process(process, timeout):
    """Wait at most `timeout` seconds; its output, after checking that it
    succeeded. On a timeout or a failure, its whole group is killed."""
    try:
        log, _ = process.communicate(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        stop_process(process)
        raise AssertionError(
            f"Timed out after {timeout:.0f} s: {process.args}"
        ) from None
    if process.returncode:
        stop_process(process)  # Whatever it started and left running.
    assert process.returncode == 0, log[-5000:]
    return log
