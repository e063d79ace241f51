"""Draws the two figures of the Concepts page into ``docs/img/``.

* ``budget.png``: the budget semantics of SPEC §2 — the cache size of one (sequence, KV head)
  over a generation (a saw-tooth between ``n_prefix + B_min`` and ``n_prefix + budget``) and what
  one eviction does to the slots;
* ``beacon-lifecycle.png``: the BeaconKV cycle of SPEC §4 — evictable count, observation buffer,
  beacon and recent sets over the decode steps, with the six steps marked.

The numbers are the library's defaults (ratio 7/8, ``n_recent = 16``, ``n_beacon = 16``) and follow
the rules of the policies exactly; the figures are drawn from the rules, not measured.

Run from the repository root (needs matplotlib, in the ``bench`` and ``test`` extras)::

    python docs/figures/make_figures.py            # writes docs/img/*.png
    python docs/figures/make_figures.py --out DIR  # somewhere else
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

RATIO, N_RECENT, N_BEACON = 7 / 8, 16, 16
COLORS = {
    "prefix": "#9e9e9e",
    "kept": "#3f6fb5",
    "evicted": "#f2c4c4",
    "recent": "#4caf50",
    "free": "#ffffff",
    "obs": "#3f6fb5",
    "beacon": "#e0892b",
    "recentq": "#4caf50",
}


def evictable_counts(budget: int, steps: int) -> tuple[list[int], list[int]]:
    """Evictable count after every decode step (prompt fully protected), and the eviction steps."""
    b_min = math.floor(RATIO * budget)
    count, counts, evictions = 0, [0], []
    for step in range(1, steps + 1):
        count += 1
        if count >= budget:
            count = b_min
            evictions.append(step)
        counts.append(count)
    return counts, evictions


def budget_figure(path: Path) -> None:
    """Saw-tooth of the cache size, and the slots of one (sequence, KV head) around an eviction."""
    n_prefix, budget = 40, 128
    b_min = math.floor(RATIO * budget)
    counts, evictions = evictable_counts(budget, 200)
    fig, (ax, lay) = plt.subplots(2, 1, figsize=(9, 6.4), height_ratios=[1.25, 1])

    size = [n_prefix + c for c in counts]
    ax.plot(range(len(size)), size, color=COLORS["kept"], lw=2, label="tokens in the cache")
    ax.axhline(n_prefix + budget, color="k", ls="--", lw=1)
    ax.axhline(n_prefix + b_min, color="k", ls=":", lw=1)
    ax.axhline(n_prefix, color=COLORS["prefix"], lw=1)
    ax.fill_between(range(len(size)), 0, n_prefix, color=COLORS["prefix"], alpha=0.35, lw=0)
    ax.text(2, n_prefix / 2, "prefix: n_prefix tokens, never evicted (default: the whole prompt)", va="center",
            fontsize=9)
    ax.text(2, n_prefix + budget + 3, "n_prefix + budget  (B_max: evict when the evictable count reaches it)",
            fontsize=9)
    ax.text(2, n_prefix + b_min - 10, "n_prefix + B_min,  B_min = floor(7/8 · budget)", fontsize=9)
    e = evictions[0]
    ax.annotate(f"evict: budget − B_min = {budget - b_min} tokens leave,\nthen every {budget - b_min} steps", (e, n_prefix + b_min),
                (e - 62, n_prefix + b_min - 48), fontsize=8, arrowprops=dict(arrowstyle="->", lw=0.8))
    ax.set_xlim(0, len(size) - 1)
    ax.set_ylim(0, n_prefix + budget + 18)
    ax.set_xlabel("decode step")
    ax.set_ylabel("tokens per (sequence, KV head)")
    ax.set_title(f"Budget semantics (n_prefix = {n_prefix}, budget = {budget}, B_min = {b_min}, n_recent = {N_RECENT})",
                 fontsize=10)

    # Slots of one (sequence, KV head): a small budget so that every slot is visible.
    p, bud = 4, 32
    bmin = math.floor(RATIO * bud)  # 28
    rec = 2
    width = p + bud
    evicted = {8, 13, 14, 23}  # the lowest scores: budget - B_min = 4 tokens leave
    kept_mid = [j for j in range(p, width - rec) if j not in evicted]
    assert len(kept_mid) + rec == bmin

    def row(y: float, kinds: list[str], labels: list[str], title: str) -> None:
        for i, (kind, lab) in enumerate(zip(kinds, labels)):
            lay.add_patch(Rectangle((i, y), 0.92, 0.8, color=COLORS[kind], ec="#444", lw=0.4))
            if lab:
                lay.text(i + 0.46, y + 0.4, lab, ha="center", va="center", fontsize=6,
                         color="white" if kind in ("kept", "recent", "prefix") else "#444")
        lay.text(-0.5, y + 0.4, title, ha="right", va="center", fontsize=9)

    before = ["prefix"] * p + ["evicted"] * bud
    for j in kept_mid:
        before[j] = "kept"
    for j in range(width - rec, width):
        before[j] = "recent"
    row(1.3, before, [str(i) for i in range(width)], "full: count = budget")
    after_pos = list(range(p)) + kept_mid + list(range(width - rec, width))
    after = ["prefix"] * p + ["kept"] * len(kept_mid) + ["recent"] * rec + ["free"] * (width - len(after_pos))
    row(0.0, after, [str(x) for x in after_pos] + [""] * (width - len(after_pos)), "after: count = B_min")
    lay.text(width / 2, 1.05, "keep prefix + last n_recent + top-k by score, compact in position order (capacity stays n_prefix + budget)",
             ha="center", va="center", fontsize=8, style="italic")
    lay.set_xlim(-12, width + 0.5)
    lay.set_ylim(-0.3, 2.4)
    lay.axis("off")
    lay.set_title(
        f"One eviction, slots of one (sequence, KV head)  (n_prefix = {p}, budget = {bud}, B_min = {bmin}, "
        f"n_recent = {rec}); numbers = positions", fontsize=9)
    lay.legend(handles=[Patch(facecolor=COLORS[k], edgecolor="#444", lw=0.4, label=lab) for k, lab in [
        ("prefix", "prefix (protected)"), ("recent", "last n_recent (protected)"),
        ("kept", "kept by score (top-k)"), ("evicted", "evicted"), ("free", "free slot")]],
        loc="upper center", bbox_to_anchor=(0.5, 1.0), ncol=5, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def lifecycle_figure(path: Path) -> None:
    """Evictable count and the three query sets of BeaconKV over the first decode steps."""
    budget, steps = 256, 340
    b_min = math.floor(RATIO * budget)
    q_min, q_max = N_BEACON, N_BEACON + N_RECENT
    freeze_at = budget - N_RECENT
    nan = float("nan")
    count, phase = 0, "accumulate"
    obs, beacons, recent = q_min, 0, 0  # step 1: FPS(prompt queries) -> B_min^Q
    xs, counts, obs_sizes, beacon_sizes, recent_sizes = [0], [0], [obs], [0], [0]
    freezes, evictions, compressions = [], [], []

    def record(step: int) -> None:
        xs.append(step)
        counts.append(count)
        obs_sizes.append(obs if phase == "accumulate" else nan)  # consumed by the freeze
        beacon_sizes.append(beacons)
        recent_sizes.append(recent)

    for step in range(1, steps + 1):
        count += 1  # write the new key
        if phase == "accumulate":  # step 2: the query joins Q_obs, compressed when full
            obs += 1
            if obs >= q_max:
                record(step)  # draw the full buffer before its compression
                obs = q_min
                compressions.append(step)
        else:
            recent += 1  # after the freeze, queries go to Q_recent
        if count >= budget:  # steps 4-6: score, select, roll
            record(step)
            count, obs, beacons, recent, phase = b_min, q_min, 0, 0, "accumulate"
            evictions.append(step)
        if phase == "accumulate" and count >= freeze_at:  # step 3: freeze
            record(step)
            beacons, phase = N_BEACON, "frozen"
            freezes.append(step)
        record(step)

    fig, (top, bot) = plt.subplots(2, 1, figsize=(9.5, 6.6), sharex=True, height_ratios=[1.15, 1])
    for ax in (top, bot):
        for f, e in zip(freezes, evictions):
            ax.axvspan(f, e, color=COLORS["recentq"], alpha=0.15, lw=0)
        for e in evictions:
            ax.axvline(e, color="#b33", lw=0.8)
    top.plot(xs, counts, color="k", lw=1.6)
    for y, label, color, ls in [(budget, f"budget = {budget}", "k", "--"),
                                (freeze_at, f"budget − n_recent = {freeze_at}", COLORS["beacon"], "--"),
                                (b_min, f"B_min = {b_min}", "k", ":")]:
        top.axhline(y, color=color, ls=ls, lw=0.8)
        top.text(steps + 3, y, label, fontsize=8, va="center", color=color)
    top.text(6, 150, "\n".join([
        "1  prefill: Q_obs ← FPS(prompt queries, 16)",
        "2  accumulate: each query joins Q_obs; at 32, Q_obs ← FPS(Q_obs, 16)",
        "3  freeze (count = budget − n_recent): Q_beacon ← FPS(Q_obs, 16);",
        "    the next n_recent queries go to Q_recent",
        "4  score (count = budget): beacons rotated to t, recent queries",
        "    to their own τ; softmax; max over queries and the GQA group",
        "5  select: prefix + last n_recent + top-k, down to B_min",
        "6  roll: Q_obs ← FPS(Q_beacon ∪ Q_recent, 16); clear both",
    ]), fontsize=8, va="center", family="monospace",
        bbox=dict(boxstyle="round", fc="white", ec="#bbb"))

    def mark(ax, x: float, y: float, label: str) -> None:
        ax.text(x, y, label, fontsize=8, ha="center", va="center", color="white", fontweight="bold",
                bbox=dict(boxstyle="circle,pad=0.25", fc="#333", ec="none"))

    mark(top, 4, 14, "1")
    mark(top, freezes[0] - 8, freeze_at + 2, "3")
    mark(top, evictions[0] + 9, budget + 4, "4-6")
    top.set_ylim(0, budget + 22)
    top.set_ylabel("evictable tokens")
    top.set_title(f"BeaconKV, one (sequence, query head): budget {budget}, n_beacon {N_BEACON}, "
                  f"n_recent {N_RECENT}; the prompt is the protected prefix", fontsize=10)

    bot.step(xs, obs_sizes, where="post", color=COLORS["obs"], lw=1.4, label="|Q_obs| (observation buffer)")
    bot.step(xs, beacon_sizes, where="post", color=COLORS["beacon"], lw=1.8, label="|Q_beacon| (frozen beacons)")
    bot.step(xs, recent_sizes, where="post", color=COLORS["recentq"], lw=1.4, label="|Q_recent|")
    bot.axhline(q_max, color=COLORS["obs"], ls="--", lw=0.7)
    bot.axhline(q_min, color=COLORS["obs"], ls=":", lw=0.7)
    bot.text(steps + 3, q_max, "B_max^Q = 32", fontsize=8, va="center")
    bot.text(steps + 3, q_min, "B_min^Q = 16", fontsize=8, va="center")
    mark(bot, compressions[0], q_max + 4, "2")
    mark(bot, evictions[0] + 6, q_min + 5, "6")
    bot.set_ylim(0, q_max + 9)
    bot.set_xlim(0, steps)
    bot.set_xlabel("decode step (shaded: the recent window, from the freeze to the eviction)")
    bot.set_ylabel("queries per head")
    bot.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8, ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Path]:
    """Writes both figures; returns their paths."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "img")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = [args.out / "budget.png", args.out / "beacon-lifecycle.png"]
    budget_figure(paths[0])
    lifecycle_figure(paths[1])
    return paths


if __name__ == "__main__":
    for p in main():
        print(p)
