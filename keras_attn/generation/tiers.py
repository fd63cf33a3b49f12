"""Which form a PyTorch decoding step takes: eager, a CUDA graph of the
exported step, or TorchInductor's compile of it; with
`generate(jit_compile="auto")`, chosen by measurement.

Compiling a step costs once (on a GPU an export and a capture, seconds; on a
CPU an export and Inductor's C++ build, tens of seconds), and then every
step of its shape is cheaper. `"auto"` rents before it buys, the ski-rental
rule (which never pays more than twice what knowing the future would cost):
a shape's steps run eagerly, over cache segments that grow with what is
written (64, 128, ... positions), timed, until the eager time spent on that
shape over every call, with what the call's remaining steps would take at
the last segment's pace, reaches what compiling costs; then, at the next
segment, the shape is compiled (over the whole length) and stays compiled.
The form is graph capture on a GPU and Inductor elsewhere. What compiling
costs is measured: the first compile of each form in a process sets it (a
fact of the machine); before one, an estimate (`ESTIMATES`).
"""

import contextlib
import threading
import time

# Seconds a compile takes before this process has timed one: export and
# capture on a GPU, export and Inductor on a CPU
# (`benchmarks/results/compile_time.md`).
ESTIMATES = {"graph": 5.0, "inductor": 25.0}
_MEASURED = {}  # form -> the seconds its last compile took in this process


class StepForms:
    """A generator's compiled steps on PyTorch, by `generate` shape (batch
    and encoder inputs), and the choice of form. `jit_compile`: `True`
    (Inductor from the first step) or `"auto"`.

    A compiled step keeps its state in buffers of its own (the caches in
    place): one decoding at a time may use them (`held`).
    """

    def __init__(self, jit_compile):
        self.jit_compile = jit_compile
        self.compiled, self.spent = {}, {}  # by shape: steps, eager seconds
        self._lock = threading.Lock()
        self._taken = False

    def held(self):
        """A context for one decoding: with `jit_compile=True` it holds the
        compiled steps (another decoding of this generator raises); with
        `"auto"` it releases them at the end, if a step took them."""
        stack = contextlib.ExitStack()
        if self.jit_compile is True:
            if not self._lock.acquire(blocking=False):
                raise RuntimeError(
                    "This compiled `generate` loop is already decoding (in "
                    "another thread, or an `on_token` callback called "
                    "`generate` again): its caches are held in place. Wait for "
                    "it, or pass jit_compile=False."
                )
            stack.callback(self._lock.release)
        else:
            stack.callback(self._release)
        return stack

    def compiles(self, key, remaining, seconds_per_step, form):
        """Whether the rest of a decoding of shape `key` runs compiled:
        always with `jit_compile=True`; with `"auto"`, where a step of that
        shape is compiled already, or compiling `form` now costs no more
        than the eager time the shape has cost and would cost over the
        `remaining` steps (`seconds_per_step`: the eager pace, `None` before
        one is measured). A compiled step is used by one decoding at a time:
        another one goes on eagerly."""
        if self.jit_compile is True:
            return True
        expected = self.spent.get(key, 0.0) + remaining * (seconds_per_step or 0.0)
        wanted = key in self.compiled or (
            seconds_per_step is not None and expected >= cost(form)
        )
        return wanted and self._take()

    def spend(self, key, seconds):
        """`seconds` of eager steps spent on shape `key`."""
        self.spent[key] = self.spent.get(key, 0.0) + seconds

    def compiled_step(self, key, make, form):
        """The compiled step of shape `key` (`make(form)` at the first call),
        its first compile timed (Inductor builds at its first call: `timed`
        wraps it)."""
        if key not in self.compiled:
            start = time.perf_counter()
            step = make(form)
            self.compiled[key] = _Timed(step, form, start)
        return self.compiled[key]

    def _take(self):
        if not self._taken:
            self._taken = self._lock.acquire(blocking=False)
        return self._taken

    def _release(self):
        if self._taken:
            self._lock.release()
            self._taken = False


class _Timed:
    """A compiled step whose first call ends its compile's timing."""

    def __init__(self, step, form, start):
        self.step, self.form, self.start = step, form, start

    def __call__(self, state, numbers):
        state = self.step(state, numbers)
        if self.start is not None:
            _MEASURED[self.form] = time.perf_counter() - self.start
            self.start = None
        return state


def cost(form):
    """The seconds a compile of `form` takes here: measured, or estimated."""
    return _MEASURED.get(form, ESTIMATES[form])
