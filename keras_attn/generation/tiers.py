"""Which form a PyTorch decoding step takes: eager, a CUDA graph of the
exported step, or TorchInductor's compile of it; with
`generate(jit_compile="auto")`, chosen by measurement.

Compiling a step costs once (on a GPU an export and a capture, seconds; on a
CPU an export and Inductor's C++ build, tens of seconds), and then every
step of its shape is cheaper. `"auto"` rents before it buys, the ski-rental
rule (which never pays more than twice what knowing the future would cost):
a shape's steps run eagerly, timed, until the eager time spent on that shape
over every call, with what the call's remaining steps would take eagerly,
reaches what compiling costs; then the shape is compiled, in the middle of a
call if need be, and stays compiled. The form is graph capture on a GPU and
Inductor elsewhere. What compiling costs is measured: the first compile of
each form in a process sets it (a fact of the machine); before one, an
estimate (`ESTIMATES`).
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
    """A generator's compiled steps on PyTorch, by shape, and the choice of
    form. `jit_compile`: `True` (Inductor from the first step) or `"auto"`.

    A compiled step keeps its state in buffers of its own (the caches in
    place): one decoding at a time may use them (`held`).
    """

    def __init__(self, jit_compile):
        self.jit_compile = jit_compile
        self.compiled, self.spent = {}, {}  # by shape: steps, eager seconds
        self._lock = threading.Lock()

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
            return stack
        self._taken = False
        stack.callback(self._release)
        return stack

    def stepper(self, key, numbers, eager, make, form):
        """The step of a decoding for a segment of shapes `key`:
        `step(state, remaining)`. `eager(state, numbers)` is the eager step,
        `make(form, state)` compiles one, `compiled(state, numbers)`
        (`"graph"` or `"inductor"`), for the shapes of `state`; `form` is
        what `"auto"` compiles to. The compiled steps are kept for the
        generator's later decodings, whose `numbers` they are given."""
        if self.jit_compile is True:
            return lambda state, remaining: self._compiled(key, make, state)(
                state, numbers
            )
        return _Rented(self, key, numbers, eager, make, form)

    def _compiled(self, key, make, state):
        if key not in self.compiled:
            self.compiled[key] = make("inductor", state)
        return self.compiled[key]

    def _take(self):
        """Whether this decoding may use the compiled steps' buffers (no
        other decoding holds them)."""
        if not self._taken:
            self._taken = self._lock.acquire(blocking=False)
        return self._taken

    def _release(self):
        if self._taken:
            self._lock.release()
            self._taken = False


class _Rented:
    """Eager steps, timed, until compiling the shape is worth what it costs
    (the module docstring); then its compiled step."""

    def __init__(self, forms, key, numbers, eager, make, form):
        self.forms, self.key, self.numbers = forms, key, numbers
        self.eager, self.make, self.form = eager, make, form
        self.timed, self.compiling = 0, None  # eager steps timed; when it began

    def __call__(self, state, remaining):
        compiled = self.forms.compiled.get(self.key)
        if compiled is not None and self.forms._take():
            state = compiled(state, self.numbers)
            if self.compiling is not None:  # Inductor builds at the first call
                _MEASURED[self.form] = time.perf_counter() - self.compiling
                self.compiling = None
            return state
        start = time.perf_counter()
        state = self.eager(state, self.numbers)
        seconds = time.perf_counter() - start
        self.timed += 1
        if self.timed > 1:  # the first step binds the sublayers' calls
            spent = self.forms.spent.get(self.key, 0.0) + seconds
            self.forms.spent[self.key] = spent
            if compiled is None and spent + remaining * seconds >= cost(self.form):
                self.compiling = time.perf_counter()
                self.forms.compiled[self.key] = self.make(self.form, state)
        return state


def cost(form):
    """The seconds a compile of `form` takes here: measured, or estimated."""
    return _MEASURED.get(form, ESTIMATES[form])
