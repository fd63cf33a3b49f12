"""The package version (ground floor: imports nothing of ours)."""

__version__ = "0.3.0"
