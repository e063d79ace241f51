"""Query selection: choose a few geometrically diverse query vectors out of many.

BeaconKV keeps, per query head, a handful of past pre-RoPE queries ("beacons") that are as different
from each other as possible, so that a future global query is likely to resemble one of them
(SPEC §3). This file holds the selection algorithms and nothing else — pure tensor logic that knows
nothing of models or caches:

- `farthest_point_sampling`: greedy farthest-point selection under cosine similarity, batched over
  any leading dims (one call for every (sequence, query head)), free of host syncs so that it can
  run inside a compiled decode step.
- `QuerySelector` and its implementations `FPS` (the BeaconKV default) and `KMeans` (spherical
  k-means, the paper's offline comparison), `make_selector` to build one by name and `parse_selector`
  for a spec such as ``"kmeans:n_iter=2"``.

How many queries a policy keeps to select from is not the selector's business: BeaconKV's
``query_memory`` setting says it (``"bounded"``, the paper's Continual FPS buffer, or ``"history"``, every
query of the sequence: Naive FPS, and K-Means as the paper runs it).

Every selection returns `(indices, selected_valid)`; slots that could not be filled because fewer
valid points than requested exist are marked invalid rather than shrinking the output, so shapes
never depend on data.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .config import PolicyConfigError, parse_settings, settings_repr

__all__ = [
    "SELECTOR_NAMES",
    "TIE_RTOL",
    "FPS",
    "KMeans",
    "QuerySelector",
    "farthest_point_sampling",
    "make_selector",
    "parse_selector",
]

# Norms are clamped to this before dividing, so a zero vector becomes the zero "direction":
# cosine 0 with everything (itself included) instead of NaN.
_NORM_EPS = 1e-12
# Up to this many points per row, FPS computes all pairwise cosines at once (see below).
_GRAM_MAX_POINTS = 256
# Sort keys for points that must not be picked while a valid candidate remains (see `_pick` and
# `farthest_point_sampling`).
_AFTER_VALID = torch.finfo(torch.float32).max
_NEVER = math.inf
TIE_RTOL = 1e-6
"""Default tie tolerance of FPS: scores this close (relative to their size, at least absolutely) count
as a tie, broken on the lowest index. Exact duplicate points can get scores one rounding step apart
when a GEMM computes their rows or columns in different blocks, and must still tie (SPEC §3)."""


def _first_min(key: Tensor, tie_rtol: float) -> Tensor:
    """Per row, the lowest index whose key lies within the tie tolerance of the row's minimum."""
    if tie_rtol == 0:
        return key.argmin(dim=-1)  # the first exact minimum
    low = key.amin(dim=-1, keepdim=True)
    # sentinel minima (no candidate left) tie exactly, so an already picked point is never taken again
    bound = torch.where(low < _AFTER_VALID, low + tie_rtol * low.abs().clamp(min=1.0), low)
    return (key <= bound).to(torch.uint8).argmax(dim=-1)  # argmax returns the first maximum


def _check_inputs(points: Tensor, k: int, valid: Tensor | None) -> None:
    """Raise PolicyConfigError when `points`, `k` or `valid` break the sampler contract."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise PolicyConfigError(f"k must be an int, got {k!r} of type {type(k).__name__}")
    if k < 0:
        raise PolicyConfigError(f"k must be >= 0, got k={k}")
    if points.ndim < 2:
        raise PolicyConfigError(
            f"points must have shape (..., N, D) with at least 2 dims, got shape "
            f"{tuple(points.shape)}; add a point axis with points.unsqueeze(-2)"
        )
    n = points.shape[-2]
    if n == 0 and k > 0:
        raise PolicyConfigError(f"cannot select k={k} points out of N=0 points; pass k=0")
    if valid is not None:
        if valid.dtype != torch.bool:
            raise PolicyConfigError(
                f"valid must be a bool tensor, got dtype {valid.dtype}; pass mask.bool()"
            )
        if valid.shape != points.shape[:-1]:
            raise PolicyConfigError(
                f"valid must have shape points.shape[:-1] = {tuple(points.shape[:-1])}, "
                f"got {tuple(valid.shape)}"
            )


def _flatten(points: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor]:
    """Flatten the leading dims: unit vectors (B, N, D) in float32 and the valid mask (B, N)."""
    *lead, n, d = points.shape
    b = math.prod(lead)
    x = points.reshape(b, n, d).to(torch.float32)
    unit = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(_NORM_EPS)
    if valid is None:
        mask = torch.ones(b, n, dtype=torch.bool, device=points.device)
    else:
        mask = valid.reshape(b, n)
    return unit, mask


def _empty_selection(points: Tensor) -> tuple[Tensor, Tensor]:
    """The k=0 answer: empty (..., 0) indices and validity."""
    shape = (*points.shape[:-2], 0)
    return (
        torch.empty(shape, dtype=torch.int64, device=points.device),
        torch.empty(shape, dtype=torch.bool, device=points.device),
    )


def _pick(score: Tensor, candidate: Tensor, taken: Tensor) -> tuple[Tensor, Tensor]:
    """Pick, per row, the candidate with the smallest score; ties go to the lowest index.

    Args:
        score: (B, N) float32, the quantity to minimise.
        candidate: (B, N) bool, valid points not taken yet.
        taken: (B, N) bool, points already picked.

    Returns:
        pick (B,) int64 and pick_valid (B,) bool. Rows without a candidate pick the lowest
        untaken index (so indices stay distinct while any are left), else index 0; those picks are
        marked invalid.
    """
    fallback = torch.where(taken, _NEVER, _AFTER_VALID)
    keyed = torch.where(candidate, score, fallback)
    pick = keyed.argmin(dim=-1)  # argmin returns the first minimum: lowest index on ties
    pick_valid = candidate.gather(1, pick[:, None]).squeeze(1)
    return pick, pick_valid


def farthest_point_sampling(
    points: Tensor, k: int, valid: Tensor | None = None, tie_rtol: float = TIE_RTOL
) -> tuple[Tensor, Tensor]:
    """Select `k` mutually dissimilar points by greedy farthest-point sampling (cosine similarity).

    The seed is the valid point with the lowest mean cosine similarity to all valid points (itself
    included). Each next point is the unselected valid point whose maximum cosine similarity to the
    already selected points is the smallest. Ties break on the lowest index: scores within
    ``tie_rtol`` (relative, at least absolute) of the best count as tied. The computation runs in
    float32 whatever the input dtype, is vectorised over the leading dims (a Python loop runs only
    over the `k` selections) and makes no host syncs, so it can run under `torch.compile`.

    Args:
        points: (..., N, D) vectors, e.g. (batch, heads, N, head_dim) pre-RoPE queries. Only their
            directions matter; zero vectors count as cosine 0 to every point.
        k: number of points to select, >= 0. May exceed N; the surplus slots are invalid.
        valid: (..., N) bool mask of the points that may be selected; None means all.
        tie_rtol: Tie tolerance (default :data:`TIE_RTOL`); 0 takes the exact minimum (duplicates may
            then break on rounding noise).

    Returns:
        indices: (..., k) int64 indices into the N axis, in selection order. The valid selections
            are a prefix of the k slots; their count is min(k, number of valid points). Indices are
            distinct across all slots when k <= N. An invalid slot holds an arbitrary index in
            range (the lowest index not yet used, or 0 once all N are used).
        selected_valid: (..., k) bool, True where the slot holds a selected valid point.

    Raises:
        PolicyConfigError: if k < 0, points has fewer than 2 dims, k > 0 with N == 0, or valid is not a
            bool tensor of shape points.shape[:-1].
    """
    _check_inputs(points, k, valid)
    if k == 0:
        return _empty_selection(points)
    lead = points.shape[:-2]
    unit, mask = _flatten(points, valid)  # (B, N, D), (B, N)
    b, _, d = unit.shape

    # Seed score: sum_j cos(i, j) over valid j = unit_i . sum_j unit_j. It is n_valid times the
    # mean, so its argmin is the same, without a division that could merge nearly equal means.
    # A GEMM may give identical points scores a rounding step apart (rows computed in different
    # blocks), hence the tie tolerance of each pick.
    total = mask.to(unit.dtype).unsqueeze(1) @ unit  # (B, 1, D)
    score = (unit @ total.transpose(1, 2)).squeeze(2)  # (B, N)
    # Cosines to each new pick: for small N, rows of the pairwise cosine matrix (one batched GEMM,
    # a few times faster than k elementwise passes over (B, N, D)); for large N (prompts), a pass
    # per pick, since the matrix grows as N^2.
    gram = unit @ unit.transpose(1, 2) if unit.shape[1] <= _GRAM_MAX_POINTS else None  # (B, N, N)

    # One sort key per point, argmin picks: a valid candidate's key is its score (<= N), an invalid
    # one's _AFTER_VALID (after every candidate, lowest index first), a picked one's _NEVER. The max
    # with a cosine leaves the last two unchanged, so each step is a handful of kernels.
    key = torch.where(mask, score, _AFTER_VALID)
    indices: list[Tensor] = []
    picked_valid: list[Tensor] = []
    for step in range(k):
        pick = _first_min(key, tie_rtol)  # lowest index on ties
        indices.append(pick)
        picked_valid.append(key.gather(1, pick[:, None]).squeeze(1) < _AFTER_VALID)
        if gram is not None:
            similarity = gram.gather(1, pick[:, None, None].expand(b, 1, gram.shape[2])).squeeze(1)
        else:
            chosen = unit.gather(1, pick[:, None, None].expand(b, 1, d))  # (B, 1, D)
            similarity = (unit * chosen).sum(dim=-1)  # (B, N) cosine to the new point
        # From now on a candidate's score is its max cosine to the selected set.
        key = torch.where(key < _AFTER_VALID, similarity, key) if step == 0 else torch.maximum(key, similarity)
        key = key.scatter(1, pick[:, None], _NEVER)
    return (
        torch.stack(indices, dim=-1).reshape(*lead, k),
        torch.stack(picked_valid, dim=-1).reshape(*lead, k),
    )


class QuerySelector(ABC):
    """Chooses `k` representative points out of N, batched over leading dims.

    Attributes:
        name: the name `make_selector` knows the selector by.
    """

    name: ClassVar[str] = "selector"

    @abstractmethod
    def select(self, points: Tensor, k: int, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Select `k` of the N points.

        Args:
            points: (..., N, D) vectors.
            k: number of points to select, >= 0.
            valid: (..., N) bool mask of selectable points; None means all.

        Returns:
            indices (..., k) int64 and selected_valid (..., k) bool, with the contract of
            `farthest_point_sampling`: valid selections are a distinct prefix of length
            min(k, number of valid points); invalid slots hold an arbitrary in-range index.
        """

    def __repr__(self) -> str:
        """The class name and the settings that differ from their defaults."""
        return settings_repr(self)


@dataclass(frozen=True, repr=False)
class FPS(QuerySelector):
    """Farthest-point sampling under cosine similarity (SPEC §3), see `farthest_point_sampling`.

    Args:
        tie_rtol: Scores this close count as a tie, broken on the lowest index (default
            :data:`TIE_RTOL`; 0 = exact minimum).
    """

    tie_rtol: float = TIE_RTOL

    name: ClassVar[str] = "fps"

    def __post_init__(self) -> None:
        if isinstance(self.tie_rtol, bool) or not isinstance(self.tie_rtol, (int, float)) or not 0 <= self.tie_rtol < 1:
            raise PolicyConfigError(f"tie_rtol={self.tie_rtol!r} must be a number in [0, 1) (default {TIE_RTOL}).")

    def select(self, points: Tensor, k: int, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Select `k` points by farthest-point sampling; see `farthest_point_sampling`."""
        return farthest_point_sampling(points, k, valid, self.tie_rtol)


@dataclass(frozen=True, repr=False)
class KMeans(QuerySelector):
    """Spherical k-means over the query history, answered with the real query nearest each centroid.

    Points are normalised to unit length; centroids start from k-means++ seeding (each next seed
    drawn with probability proportional to the squared cosine distance `(1 - max cos)^2` to the
    seeds so far, from a generator seeded with `seed`), then `n_iter` Lloyd steps assign each valid
    point to its most similar centroid and set each centroid to the normalised mean direction of its
    members (an empty cluster keeps its centroid). Finally each centroid, in seeding order, takes
    the most similar valid point not taken by an earlier centroid (**(choice)** SPEC §3: return real
    queries), so indices are distinct. Unbounded memory; for offline comparison.

    Args:
        n_iter: number of Lloyd iterations, >= 0.
        seed: seed of the k-means++ draws; the same seed gives the same selection.
    """

    n_iter: int = 20
    seed: int = 0

    name: ClassVar[str] = "kmeans"
    bounded: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if isinstance(self.n_iter, bool) or not isinstance(self.n_iter, int) or self.n_iter < 0:
            raise PolicyConfigError(f"n_iter must be an int >= 0, got n_iter={self.n_iter!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise PolicyConfigError(f"seed must be an int, got seed={self.seed!r}")

    def select(self, points: Tensor, k: int, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Select the real points nearest `k` spherical k-means centroids.

        Args:
            points: (..., N, D) vectors.
            k: number of clusters / points to select, >= 0.
            valid: (..., N) bool mask of points that take part; None means all.

        Returns:
            indices (..., k) int64 and selected_valid (..., k) bool, with the contract of
            `farthest_point_sampling`.

        Raises:
            PolicyConfigError: on the same inputs as `farthest_point_sampling`.
        """
        _check_inputs(points, k, valid)
        if k == 0:
            return _empty_selection(points)
        lead = points.shape[:-2]
        unit, mask = _flatten(points, valid)  # (B, N, D), (B, N)
        centroids, centroid_valid = self._seed_centroids(unit, mask, k)  # (B, k, D), (B, k)
        for _ in range(self.n_iter):
            centroids = self._lloyd_step(unit, mask, centroids, centroid_valid)

        # Each centroid, in order, takes its most similar untaken valid point.
        similarity = centroids @ unit.transpose(1, 2)  # (B, k, N)
        taken = torch.zeros_like(mask)
        indices: list[Tensor] = []
        picked_valid: list[Tensor] = []
        for c in range(k):
            pick, pick_valid = _pick(-similarity[:, c], mask & ~taken, taken)
            indices.append(pick)
            picked_valid.append(pick_valid & centroid_valid[:, c])
            taken = taken.scatter(1, pick[:, None], True)
        return (
            torch.stack(indices, dim=-1).reshape(*lead, k),
            torch.stack(picked_valid, dim=-1).reshape(*lead, k),
        )

    def _seed_centroids(self, unit: Tensor, mask: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """k-means++ seeding: (B, k, D) unit centroids (real points) and (B, k) validity.

        Valid centroids form a prefix of length min(k, n_valid) in every row.
        """
        b, n, d = unit.shape
        generator = torch.Generator(device=unit.device).manual_seed(self.seed)
        # one uniform per seeding round, shared by all rows: a row's selection depends only on its
        # own points and the seed, never on the other rows of the batch
        uniforms = torch.rand(k, generator=generator, device=unit.device)
        taken = torch.zeros_like(mask)
        nearest = torch.full((b, n), -math.inf, device=unit.device)  # max cos to the seeds
        seeds: list[Tensor] = []
        seed_valid: list[Tensor] = []
        for _ in range(k):
            candidate = mask & ~taken
            distance = (1.0 - nearest).clamp_min(0.0).nan_to_num(posinf=1.0)  # 1 before any seed
            weight = distance.square() * candidate
            # Rows where every candidate sits on a seed draw uniformly among candidates; rows
            # without candidates draw any untaken point (then any point) and mark it invalid.
            for fallback in (candidate, ~taken, torch.ones_like(mask)):
                empty = weight.sum(dim=-1, keepdim=True) <= 0
                weight = torch.where(empty, fallback.to(weight.dtype), weight)
            cdf = weight.cumsum(dim=-1)  # inverse-CDF draw with this round's uniform
            pick = torch.searchsorted(cdf, uniforms[len(seeds)] * cdf[:, -1:], right=True).squeeze(1).clamp(max=n - 1)
            seed_valid.append(candidate.gather(1, pick[:, None]).squeeze(1))
            taken = taken.scatter(1, pick[:, None], True)
            chosen = unit.gather(1, pick[:, None, None].expand(b, 1, d))  # (B, 1, D)
            seeds.append(chosen.squeeze(1))
            nearest = torch.maximum(nearest, (unit * chosen).sum(dim=-1))
        return torch.stack(seeds, dim=1), torch.stack(seed_valid, dim=1)

    @staticmethod
    def _lloyd_step(
        unit: Tensor, mask: Tensor, centroids: Tensor, centroid_valid: Tensor
    ) -> Tensor:
        """One spherical Lloyd iteration; returns the new (B, k, D) unit centroids."""
        k = centroids.shape[1]
        similarity = unit @ centroids.transpose(1, 2)  # (B, N, k)
        similarity = similarity.masked_fill(~centroid_valid[:, None, :], -math.inf)
        assign = similarity.argmax(dim=-1)  # (B, N)
        members = torch.nn.functional.one_hot(assign, k).to(unit.dtype)  # (B, N, k)
        members = members * mask[..., None]  # invalid points join no cluster
        direction = members.transpose(1, 2) @ unit  # (B, k, D) sum of member directions
        norm = torch.linalg.vector_norm(direction, dim=-1, keepdim=True)  # (B, k, 1)
        # Empty clusters (and members that cancel out) keep their previous centroid.
        keep = (norm <= _NORM_EPS) | ~centroid_valid[..., None]
        return torch.where(keep, centroids, direction / norm.clamp_min(_NORM_EPS))


_SELECTORS: dict[str, type[QuerySelector]] = {cls.name: cls for cls in (FPS, KMeans)}
SELECTOR_NAMES: tuple[str, ...] = tuple(_SELECTORS)
"""The names `make_selector` and `parse_selector` accept (case-insensitive)."""


def make_selector(name: str, **options: Any) -> QuerySelector:
    """Build a query selector by name.

    Args:
        name: ``"fps"`` or ``"kmeans"`` (case-insensitive).
        **options: constructor arguments of the selector, e.g. `n_iter=10, seed=1` for "kmeans".

    Returns:
        A new selector.

    Raises:
        PolicyConfigError: if `name` is not a known selector name.
    """
    key = name.lower() if isinstance(name, str) else None
    if key not in _SELECTORS:
        raise PolicyConfigError(
            f"unknown query selector {name!r}; choose one of {', '.join(repr(n) for n in SELECTOR_NAMES)}"
        )
    return _SELECTORS[key](**options)


def parse_selector(spec: str | QuerySelector) -> QuerySelector:
    """A selector from its name and settings, as the command line's ``--policy-arg sampler=...`` gives it:
    ``"fps"``, ``"kmeans:n_iter=2,seed=1"``; a selector is returned as it is.

    Raises:
        PolicyConfigError: An unknown name or setting, or a value the selector refuses.
    """
    return parse_settings("sampler", spec, QuerySelector, _SELECTORS, "kmeans:n_iter=2")
