"""Import-only placeholder (see torchvision/__init__.py)."""

from .functional import InterpolationMode  # noqa: F401
