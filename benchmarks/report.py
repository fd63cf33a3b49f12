"""How every benchmark hands in its table: written to its results folder as
Markdown, and printed (one home for what ten benchmarks did alike)."""

import os


def write_report(folder, filename, text):
    """Write `text` to `folder/filename` (the folder made if need be), print
    it, and return it."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, filename), "w") as f:
        f.write(text)
    print(text)
    return text
