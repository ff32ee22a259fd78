"""The copy backend for pools whose elements change type on the way.

A ``TransferEngine`` whose device and host pools hold the same ``PageFormat`` shape in two dtypes
(a conversion ``hicache.page_format.CONVERSIONS`` declares, exact from the device to the host)
uses this backend whatever the device: per layer, one ``index_select`` of the source pages and
one converting ``index_copy_`` into the destination pages. The job is copied at submit on the
calling thread (a CUDA side is synchronised before each layer counts as arrived), so a layer is
never seen before its bytes are there. A byte-moving backend is the fast path; this one is the
correct path for a format the fast paths cannot copy.
"""

from __future__ import annotations

import time

import torch

from hicache.l2.transfer import CopyBackend, TransferJob


class ConvertBackend(CopyBackend):
    def submit(self, job: TransferJob) -> None:
        t0 = time.perf_counter()
        try:
            self.copy(job)
        except BaseException as err:  # recorded on the job; the caller sees it as a failed copy
            job.seconds = time.perf_counter() - t0
            job._fail(err)
            return
        job.seconds = time.perf_counter() - t0
        self.engine.account(job)
        job._succeed()

    def copy(self, job: TransferJob) -> None:
        src, dst = self.engine.sides(job)
        sp, dp = src.pages, dst.pages  # [L, pages, W] views
        s = job.plan.src_pages.to(sp.device)
        d = job.plan.dst_pages.to(dp.device)
        cuda = sp.device.type == "cuda" or dp.device.type == "cuda"
        for layer in range(job.num_layers):
            rows = sp[layer].index_select(0, s).to(dp.device, dp.dtype)
            dp[layer].index_copy_(0, d, rows)
            if cuda:
                torch.cuda.synchronize(dp.device if dp.device.type == "cuda" else sp.device)
            job._layer_done(layer)
