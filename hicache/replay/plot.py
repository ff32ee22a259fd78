"""The replay sweep's plot: hit ratio against L1 capacity (one line per eviction order with
``--compare``), with the ideal and the reference (matplotlib, an optional extra)."""

from __future__ import annotations


def plot_sweep(out: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        from ..errors import ConfigError
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["sweep"]
    x = [r["capacity_pages"]["l1"] * out["page_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    if "compare" in out:  # one line per eviction order (at the sweep's capacities)
        for e in out["compare"][0]["hit_ratio"]:
            ax.plot(x, [c["hit_ratio"][e] for c in out["compare"]], "o-",
                    label=f"{e} (controller)")
    else:
        ax.plot(x, [r["hit_ratio"] for r in rows], "o-", label=f"{out['eviction']} (controller)")
    ax.plot(x, [r["reference_hit_ratio"] for r in rows], "s--",
            label="reference (evict furthest next use)")
    ax.axhline(out["ideal_hit_ratio"], color="k", ls=":", label="unlimited memory")
    ax.set_xlabel("L1 capacity (tokens)")
    ax.set_ylabel("hit ratio (prompt tokens)")
    ax.set_ylim(0, 1)
    ax.set_title(out["trace"].rsplit("/", 1)[-1])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
