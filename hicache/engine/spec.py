"""Speculative decoding beside DCP: propose k tokens with a draft, verify them in one target step.

    settings = SpecSettings("mtp" | "draft", draft_model=..., num_draft_tokens=k)
    drafter = make_drafter(settings, target, target_path, page_tokens, num_pages)  # checkpoints
    tokens = speculative_generate(runner, state, prompt, last_logits, drafter, k, n,
                                  hidden=runner.last_hidden, stats=stats)

KV placement. The target's MLA KV stays striped over the DCP group (``runner`` is the rank's
``DCPRunner``); the draft's KV is replicated: every DCP rank runs the draft on its own
``DCPLayout(1, 0, P*c)`` pool (``replicated_runner``), so it holds and computes every row
locally and the draft issues no DCP collective. Its pages have the target's widened page size
and its request shares the target's page table: draft page i holds the same positions as the
target's widened page i (the companion page a cache tier can keep under the same page id).

One round (greedy): the target has every committed token but the last (``seq[-1]``) in its KV.
The drafter proposes ``d_1..d_k``; the target extends ``[seq[-1], d_1..d_k]`` at positions
``L..L+k`` (the engine's multi-token path: attention over the shard with global causality) and
greedy-picks ``g_0..g_k``. The longest prefix with ``d_i == g_{i-1}`` is accepted (a tokens);
``d_1..d_a, g_a`` are emitted. The target's ``length`` is set to ``L + a + 1``: rows written for
rejected positions stay in pages the request already holds and are overwritten by the next step
(``DeviceIndex`` forgets them), so only accepted tokens are ever fed back or reported. The output
is the target's own greedy tokens whatever the draft proposes (lossless).

Drafters:
- ``DraftModelDrafter``: any model the engine loads (same vocabulary). It feeds the committed
  tokens it has not seen, then chains k - 1 single-token steps; rejected positions roll back.
- ``MTPDrafter``: a DeepSeek-V3 MTP module (``hicache.engine.mtp``). MTP position i pairs the
  target's final representation at i (after its final norm, as vLLM, SGLang and Megatron feed
  it) with token i+1. After each target step the module is extended over the newly committed
  positions with the target's hidden states (replacing its own chained rows), then chains
  k - 1 steps on its own final representation (after ``shared_head.norm``, as SGLang). Without the prompt's hidden
  states (a PCP prefill returns only the last logits) the module starts at the first decoded
  position: RoPE attention is relative, so its positions are counted from there.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from itertools import accumulate
from typing import Optional, Sequence

import torch

from hicache.errors import UsageError

METHODS = ("none", "mtp", "draft")
MAX_DRAFT_TOKENS = 8

__all__ = ["METHODS", "MAX_DRAFT_TOKENS", "SpecSettings", "SpecStats", "DraftModelDrafter",
           "MTPDrafter", "propose_batch", "replicated_runner", "speculative_generate"]


@dataclass(frozen=True)
class SpecSettings:
    """What to draft with: ``method`` none | mtp | draft, the draft checkpoint, k."""

    method: str = "none"
    draft_model: str = ""
    num_draft_tokens: int = 3

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UsageError(f"spec method must be one of {', '.join(METHODS)}, got "
                             f"{self.method!r}")
        k = self.num_draft_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise UsageError(f"num_draft_tokens must be an int in [1, {MAX_DRAFT_TOKENS}], got "
                             f"{k!r}")
        if self.method == "draft" and not self.draft_model:
            raise UsageError("spec method 'draft' needs a draft model (--draft-model DIR)")
        if self.method != "draft" and self.draft_model:
            raise UsageError(f"a draft model is given but the spec method is {self.method!r} "
                             "(use method 'draft')")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass
class SpecStats:
    """Counts of one request's speculative rounds (one target step each)."""

    proposed: int = 0
    accepted: int = 0
    target_steps: int = 0
    emitted: int = 0  # tokens the rounds emitted (accepted + one target token each)
    draft_recomputed_tokens: int = 0  # draft KV recomputed for cached prefixes (cache tiers)
    draft_prefill_s: float = 0.0  # the draft's prefill (reported beside, not in to_dict)

    def add_round(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.target_steps += 1
        self.emitted += accepted + 1

    def to_dict(self) -> dict:
        steps = self.target_steps
        return {"proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "mean_accepted_len": self.accepted / steps if steps else 0.0,
                "target_steps": steps,
                "tokens_per_target_step": self.emitted / steps if steps else 0.0,
                "draft_recomputed_tokens": self.draft_recomputed_tokens}


def replicated_runner(model, page_tokens: int, num_pages: int, attn_backend: str = "auto",
                      pool=None):
    """A draft engine on this rank alone: a ``DCPLayout(1, 0, page_tokens)`` pool (every row
    here, pages of the target's widened size) and no DCP collective. ``pool``: the cache's
    draft pool (``HiCache.draft.kv``, its checked port) instead of a new one."""
    from hicache.engine.runner import DCPRunner
    from hicache.l1 import DeviceKVPool
    from hicache.layout import DCPLayout
    cfg = model.cfg
    if pool is None:
        pool = DeviceKVPool(DCPLayout(1, 0, page_tokens), cfg.num_layers, cfg.kv_dim,
                            cfg.torch_dtype, num_pages, device=model.embed_tokens.device)
    elif (pool.num_layers, pool.kv_dim, pool.rows_per_page) != \
            (cfg.num_layers, cfg.kv_dim, page_tokens):
        raise UsageError(f"the cache's draft pool holds {pool.num_layers} layers x "
                         f"{pool.rows_per_page} rows x {pool.kv_dim} a page; the draft needs "
                         f"{cfg.num_layers} x {page_tokens} x {cfg.kv_dim}")
    return DCPRunner(model, pool, backend="a2a", replicate_q=True, group=None,
                     attn_backend=attn_backend)


class Drafter(abc.ABC):
    """A draft source over a replicated runner; its request shares the target's page table."""

    def __init__(self, runner, page_table: list) -> None:
        from hicache.engine.runner import RequestState
        self.runner = runner
        self.state = RequestState(page_table=page_table)

    @abc.abstractmethod
    def observe(self, hidden: Optional[torch.Tensor], start: int, end: int) -> None:
        """The target committed positions [start, end) (``hidden``: its final representation
        there, ``runner.last_hidden``: after the final norm; None when not known); positions
        >= end are not committed."""

    @abc.abstractmethod
    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens after ``seq`` (the committed tokens; the last not yet in the
        target's KV)."""

    @abc.abstractmethod
    def restored(self, draft_len: int, hit_len: int) -> int:
        """A cache hit of ``hit_len`` tokens brought the draft KV of the first ``draft_len``
        (``HiCache.prefix(rid).draft_len``): start from there. Returns the draft tokens of
        the hit to recompute (``SpecStats.draft_recomputed_tokens``)."""

    @abc.abstractmethod
    def valid_len(self) -> int:
        """Leading positions whose draft KV is this request's (for ``HiCache.finish``)."""

    @abc.abstractmethod
    def catch_up(self, seq: Sequence[int]) -> None:
        """Run the draft over what is committed, but the last position ``propose`` starts
        from (the draft's prefill, outside the decode rounds)."""


class DraftModelDrafter(Drafter):
    """A separate draft model, decoding greedily beside the target."""

    def observe(self, hidden, start: int, end: int) -> None:
        self.runner.rewind(self.state, min(self.state.length, end))

    def restored(self, draft_len: int, hit_len: int) -> int:
        if hasattr(self.runner, "states"):
            draft_len = 0  # a hybrid draft: its KDA state is not cached, so all is recomputed
        self.state.length = draft_len  # catch_up recomputes the rest of the hit
        return hit_len - draft_len

    def valid_len(self) -> int:
        return self.state.length

    @torch.no_grad()
    def catch_up(self, seq: Sequence[int]) -> None:
        st = self.state
        if len(seq) - 1 > st.length:
            self.runner.extend(st, list(seq[st.length:len(seq) - 1]))

    @torch.no_grad()
    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        st, run = self.state, self.runner  # every step can be rewound (a hybrid draft's too)
        logits = run.verify_batch([st], [list(seq[st.length:])])[0]
        out = [int(logits[-1].argmax())]
        while len(out) < k:
            out.append(int(run.verify_batch([st], [[out[-1]]], keep=True)[0][-1].argmax()))
        return out


@torch.no_grad()
def propose_batch(drafters: Sequence[Drafter], seqs: Sequence[Sequence[int]],
                  ks: Sequence[int]) -> list[list[int]]:
    """``drafter.propose(seq, k)`` of several requests. Drafters of the first one's kind (a
    draft model, or an MTP module) sharing its runner (a serving loop's) draft together: each
    step is one batched extend of every request still drafting (its pending positions first,
    then one chained token per step), so a batch of n requests costs k draft steps, not n * k;
    other drafters propose one by one."""
    out: list[list[int]] = [[] for _ in drafters]
    kind = type(drafters[0]) if drafters else None
    batch = [i for i, d in enumerate(drafters) if ks[i] > 0 and type(d) is kind
             and kind in (DraftModelDrafter, MTPDrafter) and d.runner is drafters[0].runner]
    for i, d in enumerate(drafters):
        if ks[i] > 0 and i not in batch:
            out[i] = d.propose(seqs[i], ks[i])
    if batch:
        (_draft_model_batch if kind is DraftModelDrafter else _mtp_batch)(
            drafters, seqs, ks, batch, out)
    return out


def _draft_model_batch(drafters, seqs, ks, batch: list[int], out: list[list[int]]) -> None:
    """``propose_batch`` for draft models: ``verify_batch`` steps (each can be rewound)."""
    keep, toks = False, [list(seqs[i][drafters[i].state.length:]) for i in batch]
    while batch:
        logits = drafters[0].runner.verify_batch([drafters[i].state for i in batch], toks,
                                                 keep=keep)
        for i, lg in zip(batch, logits):
            out[i].append(int(lg[-1].argmax()))
        batch = [i for i in batch if len(out[i]) < ks[i]]
        keep, toks = True, [[out[i][-1]] for i in batch]


def _mtp_batch(drafters, seqs, ks, batch: list[int], out: list[list[int]]) -> None:
    """``propose_batch`` for MTP modules: the first step runs each request's pending positions
    (on the target's hidden states), every later one a chained token on the module's own last
    hidden state, as ``MTPDrafter.propose`` does alone."""
    run = drafters[0].runner
    mtp = run.model
    pending = {i: drafters[i]._pending(seqs[i], keep=0) for i in batch}
    batch = [i for i in batch if pending[i] is not None]  # nothing to draft from yet: none
    if not batch:
        return
    toks = [pending[i][0] for i in batch]
    inputs = torch.cat([mtp.inputs(pending[i][0], pending[i][1]) for i in batch])
    while batch:
        logits = run.extend_batch([drafters[i].state for i in batch], toks, inputs=inputs)
        ends = list(accumulate(len(t) for t in toks))  # each request's rows end there
        for i, lg in zip(batch, logits):
            if i in pending:
                drafters[i]._consumed(pending.pop(i)[2])
            out[i].append(int(lg[-1].argmax()))
        more = [r for r, i in enumerate(batch) if len(out[i]) < ks[i]]
        batch = [batch[r] for r in more]
        toks = [[out[i][-1]] for i in batch]
        if batch:
            inputs = mtp.inputs([t[0] for t in toks], run.last_hidden[[ends[r] - 1 for r in more]])


class MTPDrafter(Drafter):
    """A DeepSeek-V3 MTP module fed with the target's hidden states (see the module doc)."""

    def __init__(self, runner, page_table: list) -> None:
        super().__init__(runner, page_table)
        self.offset: Optional[int] = None  # the global position of the module's position 0
        self.hidden: Optional[torch.Tensor] = None  # target hidden rows not yet consumed
        self.hidden_start = 0  # their first global position
        self.table: Optional[list] = None  # started past a cache hit: the target's table ...
        self.page_off = 0                  # ... and the module's first page in it

    def restored(self, draft_len: int, hit_len: int) -> int:
        """All of the hit's MTP rows came back (each page's last row computed with the token
        that follows it here: ``HiCache`` checks): go on from them. Otherwise they cannot be
        recomputed (they need the target's hidden states of the hit, which a hit skips): the
        module starts at the hit's end, as after a PCP prefill, with its rows in the
        request's own pages from there (never in the hit's shared pages); nothing is
        recomputed."""
        if hit_len and draft_len >= hit_len:
            self.offset, self.state.length = 0, hit_len
        elif hit_len:
            self._start_past(hit_len)
        return 0

    def _start_past(self, hit_len: int) -> None:
        """Run the module from the first position it gets hidden states for, with its rows
        in the pages after the hit's (never in the hit's shared pages)."""
        w = self.runner.page_tokens
        if hit_len % w:
            raise UsageError(f"a cache hit of {hit_len} tokens is not whole pages of {w}")
        self.offset, self.state.length = None, 0
        self.table, self.page_off = self.state.page_table, hit_len // w
        self.state.page_table = list(self.table[self.page_off:])

    def _follow_table(self) -> None:
        """Started past a hit: the module's own page table is the target's from there (it
        grows with the target's, the same list object kept)."""
        table, own = self.table, self.state.page_table
        if table is not None and len(table) - self.page_off > len(own):
            own.extend(table[self.page_off + len(own):])

    def valid_len(self) -> int:
        return self.state.length if self.offset == 0 else 0

    def observe(self, hidden, start: int, end: int) -> None:
        if hidden is None or end <= start:
            if self.offset == 0 and self.table is None and start > self.state.length:
                # restored from a cache hit, but no hidden states after it (a PCP prefill):
                # the module cannot go on from the hit, so it starts at the first decoded one
                self._start_past(self.state.length)
            return
        hidden = hidden[: end - start]
        if self.offset is None:
            self.offset = start
        st = self.state
        st.length = min(st.length, start - self.offset)  # chained rows past start are redone
        if self.hidden is not None and self.hidden_start <= start <= \
                self.hidden_start + self.hidden.shape[0]:
            hidden = torch.cat([self.hidden[: start - self.hidden_start], hidden])
            start = self.hidden_start
        self.hidden, self.hidden_start = hidden, start

    def _pending(self, seq: Sequence[int], keep: int
                 ) -> Optional[tuple[list[int], torch.Tensor, int]]:
        """What the module runs next: the tokens of the pending positions but the last
        ``keep``, the target's hidden rows before them (h_prev [T, hidden]) and the global
        position they end at; None when there is nothing to run. ``_consumed(end)`` then
        drops those rows."""
        if self.offset is None or self.hidden is None:
            return None  # nothing to draft from yet (a plain target step gives it)
        self._follow_table()
        first = self.offset + self.state.length  # the first global position to run
        if first < self.hidden_start:
            raise UsageError(f"MTP drafter: no target hidden state for positions "
                             f"{first}..{self.hidden_start - 1}")
        end = self.hidden_start + self.hidden.shape[0] - keep
        if end <= first:
            return None
        return ([int(t) for t in seq[first + 1:end + 1]],
                self.hidden[first - self.hidden_start:end - self.hidden_start], end)

    def _consumed(self, end: int) -> None:
        """The module ran up to ``end`` (what ``_pending`` returned): those hidden rows are
        used."""
        self.hidden, self.hidden_start = self.hidden[end - self.hidden_start:], end

    def _run(self, seq: Sequence[int], keep: int) -> Optional[torch.Tensor]:
        """Extend the module over the pending positions but the last ``keep``: logits, or
        None when there is nothing to run."""
        pending = self._pending(seq, keep)
        if pending is None:
            return None
        toks, h_prev, end = pending
        logits = self.runner.extend_batch([self.state], [toks],
                                          inputs=self.runner.model.inputs(toks, h_prev))[0]
        self._consumed(end)
        return logits

    @torch.no_grad()
    def catch_up(self, seq: Sequence[int]) -> None:
        self._run(seq, keep=1)

    @torch.no_grad()
    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        st, run, mtp = self.state, self.runner, self.runner.model
        logits = self._run(seq, keep=0)
        if logits is None:
            return []
        out = [int(logits[-1].argmax())]
        while len(out) < k:
            h = run.last_hidden[-1:]
            logits = run.extend_batch([st], [[out[-1]]], inputs=mtp.inputs([out[-1]], h))[0]
            out.append(int(logits[-1].argmax()))
        return out


@torch.no_grad()
def speculative_generate(runner, state, prompt: Sequence[int], last_logits: torch.Tensor,
                         drafter: Drafter, k: int, new_tokens: int,
                         hidden: Optional[torch.Tensor] = None,
                         stats: Optional[SpecStats] = None,
                         times: Optional[list] = None) -> list[int]:
    """Greedy-decode ``new_tokens`` after a prefilled ``prompt`` (``state.length ==
    len(prompt)``; ``last_logits`` [V] of its last token; ``hidden`` the target's last-layer
    output over the prompt positions, or None) with k draft tokens per target step. Returns the
    tokens (plain greedy decoding's). ``times`` gets each round's wall time."""
    stats = stats if stats is not None else SpecStats()
    out: list[int] = []
    if new_tokens <= 0:
        return out
    seq = [int(t) for t in prompt]
    seq.append(int(last_logits.argmax()))
    out.append(seq[-1])
    n = 0 if hidden is None else hidden.shape[0]
    drafter.observe(hidden, state.length - n, state.length)
    t0 = time.perf_counter()
    drafter.catch_up(seq)  # the draft's prefill: not part of the decode rounds' times
    stats.draft_prefill_s += time.perf_counter() - t0
    while len(out) < new_tokens:
        t0 = time.perf_counter()
        kk = min(k, new_tokens - len(out) - 1)  # never verify past the last wanted token
        drafts = drafter.propose(seq, kk) if kk > 0 else []
        start = state.length
        # positions start .. start + kk (a hybrid target keeps its KDA state at each)
        logits = runner.verify_batch([state], [[seq[-1]] + drafts])[0]
        picks = logits.argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == picks[a]:
            a += 1
        new = drafts[:a] + [picks[a]]
        runner.rewind(state, start + a + 1)  # rejected rows: overwritten by the next step
        seq += new
        out += new
        drafter.observe(runner.last_hidden[:a + 1], start, state.length)
        stats.add_round(len(drafts), a)
        if times is not None:
            times.append(time.perf_counter() - t0)
    return out
