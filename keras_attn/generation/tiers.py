"""Which form a PyTorch decoding step takes: eager, a CUDA graph of the
exported step, or TorchInductor's compile of it; with
`generate(jit_compile="auto")`, chosen by measurement.

Compiling a step costs once (on a GPU an export and a capture, seconds; on a
CPU an export and Inductor's C++ build, tens of seconds), and then every
step of its shape is cheaper. `"auto"` rents before it buys, as in the
ski-rental problem, with what it knows of the future counted in: a shape's
steps run eagerly, over cache segments that grow with what is written (64,
128, ... positions), timed, until the eager time spent on that shape over
every call, with what the call's remaining steps would take at the last
segment's pace (while some row is still running), reaches what compiling
costs; then, at the next segment, the shape is compiled (over the whole
length) and stays compiled. The form is graph capture on a GPU (the same
kernels as eager, replayed) and Inductor elsewhere (its kernels round
differently from eager's, in the last bits: where two tokens' logits nearly
tie, the argmax may differ; `jit_compile=False` or `True` pins the form).
What compiling costs is measured: each compile of a form in a process sets
it (a fact of the machine); before one, an estimate (`ESTIMATES`). A shape
whose compile fails (a model `torch.export` cannot trace) stays eager.
"""

import contextlib
import threading
import time

# Seconds a compile takes before this process has timed one: export and
# capture on a GPU, export and Inductor on a CPU
# (`benchmarks/results/compile_time.md`).
ESTIMATES = {"graph": 5.0, "inductor": 25.0}
_MEASURED = {}  # form -> the seconds its last compile took in this process
_EAGER = object()  # a shape whose compile failed: it stays eager


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

    def held(self):
        """The lease of one decoding on the compiled steps' buffers: with
        `jit_compile=True` taken at once (another decoding of this generator
        raises); with `"auto"` taken where a compiled step is first used
        (`compiles`), if no other decoding holds it (else it goes on
        eagerly). A context manager: it gives the buffers back."""
        lease = _Lease(self._lock)
        if self.jit_compile is True and not lease.take():
            raise RuntimeError(
                "This compiled `generate` loop is already decoding (in another "
                "thread, or an `on_token` callback called `generate` again): its "
                "caches are held in place. Wait for it, or pass jit_compile=False."
            )
        return lease

    def compiles(self, key, remaining, seconds_per_step, form, lease):
        """Whether the rest of a decoding of shape `key` runs compiled:
        always with `jit_compile=True`; with `"auto"`, where a step of that
        shape is compiled already, or compiling `form` now costs no more
        than the eager time the shape has cost and would cost over the
        `remaining` steps (`seconds_per_step`: the eager pace, `None` before
        one is measured), and the decoding's `lease` takes the buffers."""
        if self.jit_compile is True:
            return True
        if self.compiled.get(key) is _EAGER:
            return False
        expected = self.spent.get(key, 0.0) + remaining * (seconds_per_step or 0.0)
        wanted = key in self.compiled or (
            seconds_per_step is not None and expected >= cost(form)
        )
        return wanted and lease.take()

    def spend(self, key, seconds):
        """`seconds` of eager steps spent on shape `key`."""
        self.spent[key] = self.spent.get(key, 0.0) + seconds

    def compiled_step(self, key, make, form):
        """The compiled step of shape `key` (`make(form)` at the first call),
        its first compile timed (Inductor builds at its first call: `_Timed`
        ends the timing there); `None` where `"auto"` found it cannot be
        compiled (the shape then stays eager; `jit_compile=True` raises)."""
        if key not in self.compiled:
            start = time.perf_counter()
            try:
                self.compiled[key] = _Timed(make(form), form, start)
            except Exception:
                if self.jit_compile is True:
                    raise
                self.compiled[key] = _EAGER
        step = self.compiled[key]
        return None if step is _EAGER else step


class _Lease(contextlib.AbstractContextManager):
    """One decoding's hold on a generator's compiled buffers (`held`)."""

    def __init__(self, lock):
        self.lock, self.taken = lock, False

    def take(self):
        """Whether this decoding holds the buffers (taking them if free)."""
        if not self.taken:
            self.taken = self.lock.acquire(blocking=False)
        return self.taken

    def __exit__(self, *exception):
        if self.taken:
            self.lock.release()
            self.taken = False


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
