"""Import-only placeholder (see torchvision/__init__.py): the names imported at module level by
sglang.srt.multimodal and transformers.image_utils; calling anything raises."""

import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def pil_to_tensor(*args, **kwargs):
    raise ImportError("torchvision is not installed (import placeholder)")
