"""Triton kernels, each with a torch reference it is tested against.

Submodules are imported on demand (``from hicache.kernels import page_copy``) so that importing
hicache never imports triton, and tests can set ``TRITON_INTERPRET=1`` before it is imported.
"""
