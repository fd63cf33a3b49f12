"""Fixtures the checkpoint test modules share (each module writes its own
`saved` folders, which `copy` copies)."""

import shutil

import pytest

from tests.helpers.hugging_face import forbid_weight_reads


@pytest.fixture
def copy(saved, tmp_path):
    """`copy(name)`: a fresh copy of the saved folder `name` to alter."""

    def make(name, to="copy"):
        return shutil.copytree(saved[name][0], tmp_path / to)

    return make


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Fail the test if any weight is read (errors come before reads)."""
    forbid_weight_reads(monkeypatch)
