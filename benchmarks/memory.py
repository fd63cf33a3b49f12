"""How the benchmarks measure memory: a point's peak, in a fresh process.

Python's `tracemalloc` does not see the backends' allocators, so memory is the
process's resident set, as Linux keeps it in `/proc/self/status`. A point's
peak is how far the resident high-water mark (`VmHWM`), reset just before,
rises above the resident size (`VmRSS`) while the point runs. Run each point
in its own interpreter (`in_fresh_process`): memory that an earlier point
freed but the allocator kept would otherwise hide part of the next one's.

Not `resource.getrusage(RUSAGE_SELF).ru_maxrss`: in a process started by
`subprocess`, Linux carries the parent's high-water mark into it at `exec`,
so a child of a large benchmark process reports the parent's peak.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise OSError(f"No {field} in /proc/self/status.")


def high_water_bytes():
    """This process's own resident high-water mark (`VmHWM`)."""
    return _status_bytes("VmHWM")


def peak_growth(function):
    """`(function(), bytes)`: the peak resident memory `function()` adds.

    `bytes` is `None` where Linux' `/proc/self/clear_refs` (which resets the
    high-water mark) cannot be written, e.g. on macOS.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Resets VmHWM to the present VmRSS.
        before = _status_bytes("VmRSS")
    except OSError:
        return function(), None
    result = function()
    return result, _status_bytes("VmHWM") - before


def in_fresh_process(function, *args, backend):
    """`function(*args)` in a new interpreter on `backend`; its JSON result.

    `function` is a module-level function of the benchmarks (found again by
    its module and name) that returns something `json` can write.
    """
    module, name = function.__module__, function.__qualname__
    if module == "__main__":  # `python benchmarks/<name>.py`
        script = os.path.basename(sys.modules["__main__"].__file__)
        module = "benchmarks." + os.path.splitext(script)[0]
    code = (
        f"import json, {module} as m; "
        f"print(json.dumps(m.{name}(*json.loads({json.dumps(args)!r}))))"
    )
    output = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,  # Imports this checkout's `benchmarks` and `keras_attn`.
        env={**os.environ, "KERAS_BACKEND": backend},
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout
    return json.loads(output.strip().splitlines()[-1])
