"""What the examples print: a progress display that suits where the output
goes. Each example imports this module first."""

import sys


def fit_verbose():
    """`verbose` for `Model.fit`: the progress bar on a terminal, else one line
    per epoch (written to a file or a pipe, such as a CI log or `| tee`, the
    bar's redraws become long lines of control characters)."""
    return 1 if sys.stdout.isatty() else 2
