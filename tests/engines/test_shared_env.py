"""The engine environments are shared by every clone (``make engine-envs``): they hold no copy of
the package, and the tests import it from the clone that runs them (PYTHONPATH)."""

import importlib.metadata
import os

import pytest

import hicache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_package_comes_from_this_clone():
    assert os.path.dirname(os.path.dirname(os.path.abspath(hicache.__file__))) == ROOT


def test_the_shared_environment_holds_no_copy_of_the_package():
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("hicache")
