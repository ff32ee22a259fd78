"""``DraftPages`` alone: presence follows the pages through L2 copies (jobs of its own transfer
engine, per layer), a page's rows move whole, an absent page moves no bytes, and an MTP page
counts only with the token after it."""

import numpy as np
import pytest
import torch

from hicache.companions.draft import DraftPages, DraftSpec
from hicache.errors import UsageError
from hicache.page_format import PageFormat

W = 8  # P*c


def pages(pairs_next=False, dev=6, host=4):
    fmt = PageFormat.replicated(2, 4, 2, 5, torch.float32)  # 8 rows a page on every rank
    return DraftPages(DraftSpec(fmt, "sig", pairs_next=pairs_next), W, dev, host)


def fill(d, page, value):
    d._view()[:, page] = value


def done(job):
    """A companion op's job, waited for (None: nothing moved)."""
    if job is not None:
        job.wait()
    return job


def test_backup_and_load_carry_rows_and_presence():
    d = pages()
    for p in range(6):
        fill(d, p, float(p + 1))
    d.mark([1, 2])
    job = done(d.backup([1, 2, 3], [0, 1, 2]))  # page 3 has no draft KV: no bytes for it
    assert job.num_layers == 2 and job.nbytes == 2 * d.format.page_bytes  # timed, per layer
    assert list(d.l2_has[:3]) == [True, True, False]
    assert torch.all(d.l2[0] == 2.0) and torch.all(d.l2[1] == 3.0)
    assert d.stats.pages["d2h"] == 2 and d.stats.bytes["d2h"] == 2 * d.format.page_bytes
    d.forget([1, 2])
    fill(d, 4, 0.0)
    fill(d, 5, 0.0)
    done(d.load([0, 2], [4, 5]))
    assert done(d.load([2], [3])) is None  # an absent page: no job at all
    assert d.l1_has[4] and not d.l1_has[5]
    assert torch.all(d._view()[:, 4] == 2.0) and torch.all(d._view()[:, 5] == 0.0)
    assert d.present_pages([4, 5]) == 1 and d.present_pages([5, 4]) == 0
    assert d.present_pages([]) == 0


def test_an_mtp_page_counts_only_with_its_next_token():
    d = pages(pairs_next=True)
    tokens = np.arange(40)
    d.mark([0, 1, 2], [tokens[8], tokens[16], -1])  # page 2's next token is not known
    assert not d.l1_has[2]
    assert d.present_pages([0, 1], tokens) == 2
    other = tokens.copy()
    other[16] = 99  # the token after page 1 differs here
    assert d.present_pages([0, 1], other) == 1
    done(d.backup([0, 1], [0, 1]))
    d.forget([0, 1])
    done(d.load([0, 1], [3, 4]))  # the next token travels with the page
    assert d.present_pages([3, 4], tokens) == 2 and d.present_pages([3, 4], other) == 1


def test_a_draft_format_must_be_replicated_with_the_widened_rows():
    with pytest.raises(UsageError, match="must be replicated"):
        DraftSpec(PageFormat.striped_kv(2, 4, 5, torch.float32), "sig")
    with pytest.raises(UsageError, match="needs a signature"):
        DraftSpec(PageFormat.replicated(2, 4, 2, 5, torch.float32), "")
    fmt = PageFormat.replicated(2, 4, 1, 5, torch.float32)  # 4 rows, not 8
    with pytest.raises(UsageError, match="has 4 rows a page"):
        DraftPages(DraftSpec(fmt, "sig"), W, 4, 4)
