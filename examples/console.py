"""What the examples print: no TensorFlow C++ log, and a progress display that
suits where the output goes. Each example imports this module first.

Where TensorFlow is installed, every backend imports it: Keras itself on
TensorFlow, keras-hub's tokenizers, and Keras' `.keras` saving (which checks
for `tf.TensorShape`). Its C++ libraries then log "Could not find cuda
drivers", "failed call to cuInit", CPU-instruction and oneDNN notices to
stderr. Importing this module:

- sets `TF_CPP_MIN_LOG_LEVEL=3` unless it is already set, which stops that log
  (errors included; `TF_CPP_MIN_LOG_LEVEL=0` shows it all). It silences the log
  only: oneDNN and every other setting, and so the numbers, are unchanged;
- applies that level also to what TensorFlow's libraries log while they load
  (from static initializers, before they read the variable): while
  `tensorflow` is first imported, stderr is collected, and written out again
  without the log records below the level.
"""

import contextlib
import importlib.abc
import importlib.machinery
import os
import re
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# A log record's first line: absl's `I0123 12:34:56.789012  4242 file.cc:31] `
# or TensorFlow's `2025-01-23 12:34:56.789012: I tensorflow/file.cc:31] `.
LOG_RECORD = re.compile(
    r"(?P<absl>[IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\] "
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: (?P<tsl>[IWEF]) \S+:\d+\] "
)
# What absl prints before the first record of a library that did not set it up.
ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called"


def fit_verbose():
    """`verbose` for `Model.fit`: the progress bar on a terminal, else one line
    per epoch (written to a file or a pipe, such as a CI log or `| tee`, the
    bar's redraws become long lines of control characters)."""
    return 1 if sys.stdout.isatty() else 2


def below_level_removed(text, level):
    """`text` without the log records whose severity (INFO 0, WARNING 1,
    ERROR 2, FATAL 3) is below `level`. A line that does not start a record
    belongs to the record before it (the CPU-instruction notice has two)."""
    kept, keep = [], True
    for line in text.splitlines(keepends=True):
        record = LOG_RECORD.match(line)
        if record:
            keep = "IWEF".index(record["absl"] or record["tsl"]) >= level
        elif line.startswith(ABSL_NOTICE):
            keep = level == 0
        if keep:
            kept.append(line)
    return "".join(kept)


@contextlib.contextmanager
def stderr_log_filtered():
    """Collect what is written to stderr (file descriptor 2, so C++ output
    too), then write it back without the records below `TF_CPP_MIN_LOG_LEVEL`."""
    try:
        level = int(os.environ["TF_CPP_MIN_LOG_LEVEL"])
    except ValueError:
        level = 0
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as collected:
        os.dup2(collected.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            collected.seek(0)
            text = collected.read().decode(errors="replace")
            sys.stderr.write(below_level_removed(text, level))
            sys.stderr.flush()


class QuietTensorFlowImport(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` as Python would, with a loader that runs the import
    under `stderr_log_filtered`. Once TensorFlow is imported, Python no longer
    asks; where it is not installed, nothing changes.

    (Rather than importing TensorFlow here: it still loads when, and only if,
    something needs it, e.g. not in the distributed example's workers that do
    not save.)"""

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        load = spec.loader.exec_module  # A new loader for each spec.

        def exec_module(module):
            with stderr_log_filtered():
                load(module)

        spec.loader.exec_module = exec_module
        return spec


if "tensorflow" not in sys.modules:
    sys.meta_path.insert(0, QuietTensorFlowImport())
