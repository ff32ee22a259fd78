"""A router could route on hicache's KV events: an index built only from the event stream (ZMQ,
replay for what a late join missed, a reader from vLLM's documented schema) predicts, for every
request, the hit tokens per tier the cache then reports (L1, L2, L3), through L1 evictions, L2
demotions and evictions, a restart on one L3 and an L3 purge, in two scopes and the shared one;
and the stream never names a scope."""

import numpy as np

from hicache.scope import make_scope, public_digest
from hicache.service import HiCache

from helpers import make_cfg, write_kv_rows, l3_writes_land_at_once
from kv_index import Subscriber

PT = 4


def requests(seed: int, n: int):
    """(prompt, scope, public tokens): prompts from a few sessions sharing a system prompt,
    growing turn by turn, in scopes a, b and the shared one."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 128, 9)
    sessions = [np.concatenate([system, rng.integers(0, 128, int(rng.integers(3, 14)))])
                for _ in range(6)]
    out = []
    for _ in range(n):
        s = int(rng.integers(0, len(sessions)))
        if rng.random() < 0.5:  # the session grows
            sessions[s] = np.concatenate([sessions[s], rng.integers(0, 128, int(rng.integers(2, 9)))])
        scope = [None, "tenant-a", "tenant-b"][s % 3]
        out.append((sessions[s][:44], scope, 9 if s % 2 else 0))
    return out


def serve_one(cache, sub, rid, prompt, scope, public):
    """Predict from the index, then admit and compare with what the cache reports."""
    sub.wait(cache.events.publisher.queued)
    sc = make_scope(scope, public, PT)
    want = sub.index.predict(prompt.tolist(), PT, public_digest(sc.tag) if sc else None,
                             sc.public_pages if sc else 0)
    p = cache.admit(rid, prompt, scope, public)
    while not p.ready:
        cache.step()
    got = {"l1": p.device_len, "l2": p.host_len, "l3": p.storage_len}
    cache.alloc(rid, len(prompt))
    write_kv_rows(cache, rid, len(prompt))
    cache.finish(rid, prompt)
    cache.step()
    return want, got


def test_an_index_built_from_the_events_predicts_every_hit(tmp_path):
    sub = Subscriber("tcp://127.0.0.1:0", f"ipc://{tmp_path}/replay", miss=2)
    cfg = make_cfg(tmp_path / "l3", l1_pages=16, l2_ratio=1.5, prefetch="wait_complete")
    cfg = cfg.replace(events={"endpoint": sub.endpoint, "replay_endpoint": sub.replay,
                              "topic": "kv@pod-0@tiny"})
    reqs = requests(0, 60)
    seen = {"l1": 0, "l2": 0, "l3": 0}
    rows = []
    try:
        with l3_writes_land_at_once():
            for phase, part in enumerate((reqs[:30], reqs[30:45], reqs[45:])):
                with HiCache(cfg, 0, None, mode="l1+l2+l3") as cache:
                    if phase == 2:
                        assert cache.purge_l3() > 0
                    for i, (prompt, scope, public) in enumerate(part):
                        want, got = serve_one(cache, sub, (phase, i), prompt, scope, public)
                        rows.append((phase, i, want, got))
                        for t in seen:
                            seen[t] += got[t]
                    stats = cache.stats()
                    pub = cache.events.publisher
                sub.wait(pub.queued)
                sub.restarted()
                assert stats["kv_events"]["dropped"] == 0 and stats["evictions"]["l1"] > 0
                assert stats["evictions"]["l2"] > 0
    finally:
        sub.close()
    bad = [r for r in rows if r[2] != r[3]]
    assert not bad, bad[:5]
    assert all(v > 0 for v in seen.values()), seen  # every tier was predicted, and hit
    assert all(r[3]["l3"] == 0 for r in rows if r[0] == 2 and r[1] < 3)  # purged
    assert sub.replayed > 0 and sub.topics == {b"kv@pod-0@tiny"} and sub.ranks == {0}
    # two scopes: two public digests in extra_keys, never a scope's name or tag
    tags = [make_scope(s, 0, PT).tag for s in ("tenant-a", "tenant-b")]
    assert sub.index.extra_seen == {(public_digest(t),) for t in tags}
    for payload in sub.index.payloads:
        for secret in [b"tenant-a", b"tenant-b"] + tags + [t.hex().encode() for t in tags]:
            assert secret not in payload



def test_l3_pages_gone_behind_the_cache_are_announced_when_a_lookup_misses_them(tmp_path):
    """Pages this cache announced in L3 and another process then deleted (``hicache l3 purge``
    in its own process; the store evicting them is the same to the cache) leave the routers'
    view at the first lookup that finds them missing: a ``BlockRemoved`` for ``STORAGE`` names
    the first missing page, so the index stops predicting the L3 hit the cache no longer has
    (until the page is written again)."""
    import json
    import subprocess
    import sys

    from kv_index import ROOT, read_batch, router_key

    sub = Subscriber("tcp://127.0.0.1:0", f"ipc://{tmp_path}/replay")
    cfg = make_cfg(tmp_path / "l3", l1_pages=16, l2_ratio=1.5, prefetch="wait_complete")
    cfg = cfg.replace(events={"endpoint": sub.endpoint, "replay_endpoint": sub.replay,
                              "topic": "kv@pod-0@tiny"})
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 128, 23) for _ in range(3)]
    fillers = [rng.integers(128, 256, 23) for _ in range(12)]  # push them out of L1 and L2
    first = [router_key(ROOT, p[:PT].tolist(), None) for p in prompts]
    try:
        with l3_writes_land_at_once(), HiCache(cfg, 0, None, mode="l1+l2+l3") as cache:
            for i, p in enumerate(prompts + fillers):
                serve_one(cache, sub, i, p, None, 0)
            sub.wait(cache.events.publisher.queued)
            assert all(k in sub.index.media["STORAGE"] for k in first)
            r = subprocess.run([sys.executable, "-m", "hicache.commands.cli", "l3", "purge",
                                str(tmp_path / "l3"), "--namespace",
                                cache.namespace.digest.hex(), "--json"],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["keys"] > 0
            for k, p in enumerate(prompts[:2]):
                seen = len(sub.index.payloads)
                want, got = serve_one(cache, sub, ("again", k), p, None, 0)
                assert want["l3"] > 0 and got["l3"] == 0  # the router's view was stale
                sub.wait(cache.events.publisher.queued)
                removed = [sub.index.key_of.get(h) for payload in sub.index.payloads[seen:]
                           for kind, e in read_batch(payload)[1]
                           if kind == "BlockRemoved" and e["medium"] == "STORAGE"
                           for h in e["block_hashes"]]
                assert removed == [first[k]]  # its first page only: all a prefix read misses
            # a page no lookup has asked for since is still in the view (nothing is guessed)
            assert first[2] in sub.index.media["STORAGE"]
            assert cache.stats()["kv_events"]["dropped"] == 0
    finally:
        sub.close()
