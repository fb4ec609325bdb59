"""The analysis figures, which a first reading skips: matplotlib on the numbers 06_analysis.py computes (entropy
phases, overlays, hidden-state maps, separation, re-scored log-probs, interference, tallies). Pure plotting: no
number is computed here that a figure does not show.
"""
import torch

from helpers.runs import finite, series


PHASE_COLORS = {"eruption": "tab:red", "subsidence": "tab:orange"}


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def shade(ax, info):
    for a, p, e in info["eruptions"]:
        ax.axvspan(a, p, color=PHASE_COLORS["eruption"], alpha=0.15, lw=0)
        if e > p:
            ax.axvspan(p, e, color=PHASE_COLORS["subsidence"], alpha=0.15, lw=0)


def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def plot_entropy(infos, path):
    """(a) top: smoothed entropy of every run; below: each run's raw + smoothed curve with its phases shaded."""
    plt = pyplot()
    fig, axes = plt.subplots(len(infos) + 1, 1, figsize=(9, 2.6 * (len(infos) + 1)), sharex=True, squeeze=False)
    for i, info in enumerate(infos):
        axes[0, 0].plot(info["updates"], info["phases"]["smoothed"], color=f"C{i}", label=info["name"])
        ax = axes[i + 1, 0]
        ax.plot(info["updates"], info["entropy"], color=f"C{i}", alpha=0.35, lw=1, label="per update")
        ax.plot(info["updates"], info["phases"]["smoothed"], color=f"C{i}", label="smoothed")
        shade(ax, info)
        ax.set_title(f"{info['name']}: {len(info['eruptions'])} eruption(s) (red rising, orange subsiding)", fontsize=9)
        ax.set_ylabel("entropy (nats)")
        ax.legend(fontsize=7)
    axes[0, 0].set_title("mean token entropy (smoothed)", fontsize=9)
    axes[0, 0].legend(fontsize=7)
    axes[-1, 0].set_xlabel("update")
    return save(fig, path)


def plot_overlay(infos, keys, path):
    """One panel per key, one line per run (runs side by side)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.2), squeeze=False)
    for ax, k in zip(axes[0], keys):
        for i, info in enumerate(infos):
            u, v = series(info["rows"], k)
            ax.plot(u, v, "o-" if k.startswith("val_") else "-", ms=3, color=f"C{i}", label=info["name"])
        ax.set_title(k, fontsize=9)
        ax.set_xlabel("update")
        ax.legend(fontsize=7)
    return save(fig, path)


def plot_rows(infos, keys, path, ylabel):
    """One panel per run with every key as a line and the run's eruption intervals shaded."""
    plt = pyplot()
    fig, axes = plt.subplots(len(infos), 1, figsize=(9, 2.8 * len(infos)), sharex=True, squeeze=False)
    for ax, info in zip(axes[:, 0], infos):
        for k in keys:
            u, v = series(info["rows"], k)
            ax.plot(u, v, label=k)
        shade(ax, info)
        ax.set_title(info["name"], fontsize=9)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("update")
    return save(fig, path)


def plot_hidden(info, path, panels=4):
    """(e) PCA map (fit on all of the run's saved trajectories) at up to `panels` saved updates, correct vs wrong."""
    plt = pyplot()
    hid = info["hidden"]
    ups = sorted(hid)
    n = min(panels, len(ups))
    pick = sorted({ups[round(i * (len(ups) - 1) / max(n - 1, 1))] for i in range(n)})
    Z = pca2(torch.cat([hid[u][0] for u in ups]))
    fig, axes = plt.subplots(1, len(pick), figsize=(3.4 * len(pick), 3.3), squeeze=False)
    offset = 0
    for u in ups:
        X, won = hid[u]
        z, offset = Z[offset:offset + len(X)], offset + len(X)
        if u in pick:
            ax = axes[0, pick.index(u)]
            w = torch.tensor(won)
            ax.scatter(z[~w, 0], z[~w, 1], s=12, color="tab:red", alpha=0.7, label="wrong")
            ax.scatter(z[w, 0], z[w, 1], s=12, color="tab:green", alpha=0.7, label="correct")
            ax.set_title(f"update {u}: Fisher {info['separation'][u]:.3g}", fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle(f"{info['name']}: mean last-layer hidden state per trajectory (PCA)", fontsize=9)
    return save(fig, path)


def plot_separation(infos, path):
    """(e) separation score over the saved updates; dashed lines at each run's eruption peaks."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for i, info in enumerate(infos):
        pts = [(u, v) for u, v in info["separation"].items() if finite(v)]
        ax.plot([u for u, _ in pts], [v for _, v in pts], "o-", ms=3, color=f"C{i}", label=info["name"])
        for _, p, _ in info["eruptions"]:
            ax.axvline(p, color=f"C{i}", ls="--", lw=0.8)
    ax.set_xlabel("update")
    ax.set_ylabel("||mu_c - mu_w||^2 / (tr S_c + tr S_w)")
    ax.set_title("hidden-state separation of correct vs wrong trajectories (dashed: eruption peaks)", fontsize=9)
    ax.legend(fontsize=7)
    return save(fig, path)


def plot_rescore(info, res, path, keys):
    """(C4) the fixed steps' mean token log-prob at each snapshot, with the run's smoothed entropy."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ups = [p["update"] for p in res["points"]]
    for k in keys:
        if all(p.get(k) is not None for p in res["points"]):
            ax.plot(ups, [p[k] for p in res["points"]], "o-", ms=4, label=k)
    ax.set_xlabel("update (snapshot)")
    ax.set_ylabel(f"mean token logp of {res['steps']} fixed steps", fontsize=8)
    ax2 = ax.twinx()
    ax2.plot(info["updates"], info["phases"]["smoothed"], color="gray", alpha=0.6, label="entropy (smoothed)")
    ax2.set_ylabel("entropy (nats)")
    shade(ax2, info)
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title(f"{info['name']}: fixed steps re-scored at each snapshot", fontsize=9)
    return save(fig, path)


def plot_interference(res, path):
    """(f) c_j against A_j, one panel per checkpoint."""
    plt = pyplot()
    pts = res["points"]
    fig, axes = plt.subplots(1, len(pts), figsize=(3.8 * len(pts), 3.4), squeeze=False)
    for ax, p in zip(axes[0], pts):
        ax.scatter(p["A"], p["c"], s=12)
        ax.axhline(0, color="grey", lw=0.6)
        ax.axvline(0, color="grey", lw=0.6)
        ax.set_xlabel("advantage A_j")
        ax.set_ylabel("c_j = (1/G) sum_i <g_i, g_j>")
        ax.set_title(f"ckpt {p['update']} ({p['where']})\nrollouts {p['rollout_update']}, "
                     f"(1/G) sum A_j c_j = {p['sum_Ac_over_G']:.3g}", fontsize=8)
    return save(fig, path)


def plot_tallies(t, threshold, path):
    """(C4 over runs) change of the fixed valid (and expert) steps' log-prob against the change of smoothed entropy
    between consecutive snapshots, one point per interval of every run."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for k, marker, name in (("logp_valid", "o", "valid steps (sampled)"), ("logp_expert", "x", "the expert's steps")):
        if t["changes"].get(k):
            ax.scatter(*zip(*t["changes"][k]), s=14, marker=marker, label=name)
    ax.legend(fontsize=7)
    for x in (-threshold, threshold):
        ax.axvline(x, color="0.6", ls="--", lw=1)
    ax.axhline(0, color="0.3", lw=0.8)
    ax.set_xlabel("change of smoothed entropy between snapshots (nats)")
    ax.set_ylabel("change of mean token logp", fontsize=8)
    ax.set_title(f"C4 over runs: {len(t['changes']['logp_valid'])} snapshot intervals (dashed: eruption threshold)",
                 fontsize=9)
    return save(fig, path)


def pca2(X):
    """Projection of the rows of X onto their top-2 principal directions (SVD of the centred matrix)."""
    Xc = X - X.mean(0)
    _, _, Vh = torch.linalg.svd(Xc, full_matrices=False)
    return Xc @ Vh[:2].T if Vh.shape[0] >= 2 else torch.cat([Xc @ Vh.T, torch.zeros(len(X), 1, dtype=X.dtype)], 1)
