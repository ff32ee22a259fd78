"""The engine environments are shared by every clone (``make engine-envs``): they hold no copy of
the package, and the tests import it from the clone that runs them (PYTHONPATH)."""

import importlib.metadata
import os
import sys

import hicache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_package_comes_from_this_clone():
    assert os.path.dirname(os.path.dirname(os.path.abspath(hicache.__file__))) == ROOT


def test_the_shared_environment_holds_no_copy_of_the_package():
    found = [str(d.locate_file("")) for d in importlib.metadata.distributions()
             if (d.metadata["Name"] or "").lower() == "hicache"]
    # a build of the clone may leave its own metadata (hicache.egg-info) in the clone
    assert all(os.path.realpath(p).startswith(ROOT) for p in found), found
    assert not any(os.path.realpath(p).startswith(os.path.realpath(sys.prefix)) for p in found)
