"""Build hook only (the project is described in pyproject.toml): the wheel ships the example
policy file as ``hicache/policy.toml``, the documented defaults that ``hicache-bench`` and
``hicache check-config`` use when no file is given (examples/ itself is not a package)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPy(build_py):
    def run(self):
        super().run()
        dst = Path(self.build_lib) / "hicache" / "policy.toml"
        dst.parent.mkdir(parents=True, exist_ok=True)
        self.copy_file(str(HERE / "examples" / "policy.toml"), str(dst))


setup(cmdclass={"build_py": BuildPy})
