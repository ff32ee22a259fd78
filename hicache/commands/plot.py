"""Plots of a hicache-bench report (matplotlib, an optional extra): per workload, the TTFT
distribution of every mode and the hit ratio by tier."""

from __future__ import annotations

import numpy as np

FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")  # --plot file extensions
TIER_COLORS = {"l1": "#2b6cb0", "l2": "#dd8a2b", "l3": "#3b9c5a"}


def plot_report(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.6 * len(workloads)),
                             squeeze=False)
    for (ax_t, ax_h), w in zip(axes, workloads):
        for mode in w["modes"]:
            ttft = np.sort(np.asarray([r["ttft_s"] for r in mode["requests"]]) * 1e3)
            ax_t.step(ttft, np.arange(1, len(ttft) + 1) / max(len(ttft), 1), where="post",
                      label=mode["name"])
        ax_t.set_xscale("log")
        ax_t.set_xlabel("TTFT (ms)")
        ax_t.set_ylabel("fraction of requests")
        ax_t.set_title(f"{w['workload']}: TTFT distribution")
        ax_t.legend(fontsize=8)
        names = [m["name"] for m in w["modes"]]
        bottom = np.zeros(len(names))
        for tier, color in TIER_COLORS.items():
            share = np.array([m["hit_tokens"][tier] / max(m["prompt_tokens"], 1)
                              for m in w["modes"]])
            ax_h.bar(names, share, bottom=bottom, color=color, label=tier)
            bottom += share
        if w.get("ideal_hit_ratio") is not None:
            ax_h.axhline(w["ideal_hit_ratio"], color="k", ls="--", lw=1, label="unlimited memory")
        ax_h.set_ylim(0, 1)
        ax_h.set_ylabel("prompt tokens served from cache")
        ax_h.set_title(f"{w['workload']}: hit ratio by tier")
        ax_h.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
