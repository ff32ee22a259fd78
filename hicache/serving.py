"""A continuous-batching serving loop: the DCP MLA engine with HiCache embedded.

Each scheduler step, on every rank in lockstep:
  1. admit the next waiting request while fewer than ``max_running`` are active;
  2. ``HiCache.step()``: the one agreement collective (finished transfers, L3 lookups);
  3. prefill, in chunks, only the unmatched suffix of requests whose prefix is ready
     (``wait_layer`` before each layer overlaps the L2 load-back with compute);
  4. one decode token for every decoding request (one batched extend);
  5. finish requests that emitted all their tokens (insert, unlock, back up per policy).
Cache hits change nothing in the output: the same token ids for every mode.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from .config import HiCacheConfig
from .controller import DeviceFullError
from .engine.model import MLAModel, ModelConfig
from .engine.runner import DCPRunner, RequestState
from .service import HiCache


class ServingError(RuntimeError):
    """A request the configured cache can never run (e.g. larger than L1)."""


def model_config(cfg: HiCacheConfig, seed: int = 0) -> ModelConfig:
    """The built-in engine's model for a policy file's [model] section."""
    m = cfg.model
    return ModelConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                       num_layers=m.num_layers, num_heads=m.num_heads,
                       kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.rope_dim,
                       intermediate_size=2 * m.hidden_size, dtype=m.dtype, seed=seed)


@dataclass
class Result:
    request_id: object
    prompt_len: int
    output: list[int]
    ttft_s: float
    hit: dict  # tokens per tier: {"l1", "l2", "l3"}


@dataclass
class _Active:
    job: object  # request_id, tokens (int array), output_len (>= 1)
    prefix: object
    admitted: float
    state: RequestState | None = None
    output: list[int] = field(default_factory=list)
    ttft: float = 0.0


class Server:
    """Runs jobs through a ``DCPRunner`` whose KV lives in ``cache``'s L1 pool."""

    def __init__(self, model: MLAModel, cache: HiCache, *, backend: str = "a2a",
                 replicate_q: bool = True, group=None, chunk_tokens: int = 512,
                 max_running: int = 4, stall_steps: int = 200_000) -> None:
        if chunk_tokens < 1 or max_running < 1:
            raise ServingError(f"chunk_tokens and max_running must be >= 1, got {chunk_tokens} "
                               f"and {max_running}")
        self.stall_steps = stall_steps
        self.cache = cache
        self._waiting_on: list = []
        self.runner = DCPRunner(model, cache.l1, backend=backend, replicate_q=replicate_q,
                                group=group, layer_hook=self._wait_layer)
        self.chunk_tokens = chunk_tokens
        self.max_running = max_running
        self.prefill_tokens = 0
        self.prefill_s = 0.0

    def _wait_layer(self, layer: int) -> None:
        for rid in self._waiting_on:
            self.cache.wait_layer(rid, layer)

    def run(self, jobs: Sequence, on_done: Callable[[Result], None] | None = None
            ) -> list[Result]:
        cache, vps = self.cache, self.cache.page_tokens
        capacity = cache.config.l1.num_pages * vps
        waiting = deque(jobs)
        active: list[_Active] = []
        results: list[Result] = []
        admitted_at: dict = {}  # first admission: a preempted request's wait counts in its TTFT
        stalled = 0
        while waiting or active:
            progress = len(results)
            if waiting and len(active) < self.max_running:
                job = waiting.popleft()
                need = len(job.tokens) + job.output_len
                if need > capacity:
                    raise ServingError(f"request {job.request_id!r} needs {need} tokens of KV but "
                                       f"L1 holds {capacity} (l1.num_pages)")
                t_admit = admitted_at.setdefault(job.request_id, time.perf_counter())
                active.append(_Active(job, cache.admit(job.request_id, job.tokens), t_admit))
            # The step's one collective right after admission: a request whose L3 lookup found
            # nothing on any rank is ready in this same iteration.
            cache.step()
            started = sum(self._prefill(a) for a in active
                          if a.state is None and a.prefix.ready)
            decoding = [a for a in active if a.state is not None and len(a.output) < a.job.output_len]
            stuck = [a for a in active if a.state is None and a.prefix.ready]
            if stuck and not started and not decoding:
                # Nothing runs and L1 is held by the locked hits of waiting requests (their
                # matches may also be stale: a host hit another request recomputed is now on the
                # device). Preempt them and admit again, oldest first: the same decision on every
                # rank, since the controller state is replicated.
                for a in reversed(stuck):
                    cache.abort(a.job.request_id)
                    active.remove(a)
                    waiting.appendleft(a.job)
            if decoding:
                logits = self.runner.extend_batch([a.state for a in decoding],
                                                  [[a.output[-1]] for a in decoding])
                for a, lg in zip(decoding, logits):
                    a.output.append(int(lg[-1].argmax()))
            for a in [a for a in active if a.state is not None
                      and len(a.output) >= a.job.output_len]:
                active.remove(a)
                fed = np.concatenate([a.job.tokens, np.asarray(a.output[:-1], dtype=np.int64)])
                cache.finish(a.job.request_id, fed)
                p = a.prefix
                r = Result(a.job.request_id, len(a.job.tokens), a.output, a.ttft,
                           {"l1": p.device_len, "l2": p.host_len, "l3": p.storage_len})
                results.append(r)
                if on_done is not None:
                    on_done(r)
            # Counted in steps, not seconds, so every rank gives up at the same step.
            stalled = 0 if (started or decoding or len(results) != progress) else stalled + 1
            if stalled > self.stall_steps:
                raise ServingError("no request can get L1 pages: l1.num_pages is too small "
                                   f"for {len(active)} concurrent requests")
        return results

    def _prefill(self, a: _Active) -> bool:
        """Prefill the unmatched suffix; True when the request started decoding."""
        job, prefix = a.job, a.prefix
        try:
            self.cache.alloc(job.request_id, len(job.tokens) + job.output_len)
        except DeviceFullError:
            return False  # L1 is busy with running requests: retry after the next step
        state = RequestState(page_table=prefix.page_table, length=prefix.hit_len)
        suffix = torch.as_tensor(job.tokens[prefix.hit_len:], dtype=torch.int64)
        self._waiting_on = [job.request_id]
        t0 = time.perf_counter()
        try:
            for s in range(0, len(suffix), self.chunk_tokens):
                logits = self.runner.extend(state, suffix[s:s + self.chunk_tokens])
        finally:
            self._waiting_on = []
        dt = time.perf_counter() - t0
        self.prefill_s += dt
        self.prefill_tokens += len(suffix)
        self.cache.observe_prefill(len(suffix), dt)
        a.output.append(int(logits[-1].argmax()))
        a.ttft = time.perf_counter() - a.admitted
        a.state = state
        return True
