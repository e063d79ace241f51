"""Tests of query selection: FPS against a float64 brute force, its contract, KMeans, factory, strings.

Random cases come from a torch generator seeded by Hypothesis, so failures shrink to small seeds and
shapes. Float32 FPS and the float64 reference may disagree on near-ties; the reference therefore
accepts any pick within `TOL` of the best score, and exact ties (identical points) are checked
exactly: the lowest index must win.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from beaconkv.policies import BeaconKV, query_selection
from beaconkv.policies.config import PolicyConfigError
from beaconkv.policies.query_selection import (
    FPS,
    SELECTOR_NAMES,
    KMeans,
    QuerySelector,
    farthest_point_sampling,
    make_selector,
    parse_selector,
)

TOL = 1e-5  # float32 cosines vs float64: a pick within TOL of the best counts as a near-tie
FAST = settings(max_examples=40, deadline=None)


# --- random cases ------------------------------------------------------------------------------


@st.composite
def fps_cases(draw, max_n: int = 40, max_d: int = 16):
    """(points (..., N, D), k, valid (..., N)) with at least one valid point per row.

    Some cases copy rows onto others (exact duplicates: exact ties) or zero rows out.
    """
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    n = draw(st.integers(1, max_n))
    d = draw(st.integers(1, max_d))
    k = draw(st.integers(0, n))
    structure = draw(st.sampled_from(["random", "duplicates", "zeros"]))
    p_valid = draw(st.sampled_from([0.2, 0.6, 1.0]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))

    points = torch.randn(*lead, n, d, generator=g)
    if structure == "duplicates":
        source = torch.randint(n, (n,), generator=g)
        copy = torch.rand(*lead, n, 1, generator=g) < 0.4
        points = torch.where(copy, points[..., source, :], points)
    elif structure == "zeros":
        points = points * (torch.rand(*lead, n, 1, generator=g) > 0.2)
    valid = torch.rand(*lead, n, generator=g) < p_valid
    always = torch.randint(n, (*lead, 1), generator=g)
    valid = valid.scatter(-1, always, True)
    return points.to(dtype), k, valid


def rows(points: torch.Tensor, valid: torch.Tensor, *selection: torch.Tensor):
    """Iterate over the flattened leading dims: (points (N, D), valid (N,), *selection rows)."""
    n, d = points.shape[-2:]
    m = valid.numel() // n
    flat = [points.reshape(m, n, d), valid.reshape(m, n)]
    flat += [s.reshape(m, s.shape[-1]) for s in selection]
    return zip(*flat)


# --- float64 brute force -----------------------------------------------------------------------


def cosine_matrix(points: torch.Tensor) -> list[list[float]]:
    """Pairwise cosine in float64 (zero vectors: cosine 0), as nested Python lists."""
    x = points.double()
    unit = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-12)
    return (unit @ unit.T).tolist()


def reference_scores(
    cos: list[list[float]], valid: list[bool], selected: list[int]
) -> dict[int, float]:
    """Score of every candidate (valid, unselected) point; FPS picks the smallest.

    No selection yet: mean cosine to all valid points (itself included). Otherwise: maximum cosine
    to the selected points.
    """
    n = len(valid)
    members = [j for j in range(n) if valid[j]]
    scores = {}
    for i in range(n):
        if not valid[i] or i in selected:
            continue
        if selected:
            scores[i] = max(cos[s][i] for s in selected)
        else:
            scores[i] = sum(cos[i][j] for j in members) / len(members)
    return scores


def assert_farthest(
    chosen: int, scores: dict[int, float], points: torch.Tensor, exact_ties: bool = True
) -> None:
    """`chosen` is a best candidate up to TOL, and (with `exact_ties`, when the selection was made
    on `points` themselves) the lowest index among its exact duplicates."""
    best = min(scores.values())
    assert scores[chosen] <= best + TOL, (chosen, scores[chosen], best)
    for i in scores if exact_ties else ():
        if i < chosen:
            assert not torch.equal(points[i], points[chosen]), f"tie {i} < {chosen} not broken low"


def assert_matches_brute_force(points, valid, indices, selected_valid, exact_ties=True) -> None:
    """Every valid pick of FPS is a brute-force farthest point given the picks before it."""
    for p, v, idx, ok in rows(points, valid, indices, selected_valid):
        cos = cosine_matrix(p)
        v_list = v.tolist()
        picks = idx[ok].tolist()
        for step, chosen in enumerate(picks):
            assert_farthest(chosen, reference_scores(cos, v_list, picks[:step]), p, exact_ties)


# --- FPS: contract -----------------------------------------------------------------------------


@FAST
@given(fps_cases(), st.sampled_from([FPS(), KMeans(n_iter=5)]))
def test_selection_contract(case, sampler):
    points, k, valid = case
    indices, selected_valid = sampler.select(points, k, valid)
    lead, n = points.shape[:-2], points.shape[-2]
    assert indices.shape == selected_valid.shape == (*lead, k)
    assert indices.dtype == torch.int64 and selected_valid.dtype == torch.bool
    assert ((indices >= 0) & (indices < n)).all()
    for _, v, idx, ok in rows(points, valid, indices, selected_valid):
        expected = min(k, int(v.sum()))
        assert ok.tolist() == [True] * expected + [False] * (k - expected)  # a valid prefix
        assert v[idx[ok]].all()  # valid picks point at valid points
        assert len(set(idx.tolist())) == k  # distinct, invalid slots included (k <= N)


@FAST
@given(fps_cases())
def test_deterministic(case):
    points, k, valid = case
    first = farthest_point_sampling(points, k, valid)
    second = farthest_point_sampling(points, k, valid)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@FAST
@given(fps_cases())
def test_seed_is_lowest_mean_cosine(case):
    points, k, valid = case
    indices, selected_valid = farthest_point_sampling(points, max(k, 1), valid)
    for p, v, idx, ok in rows(points, valid, indices, selected_valid):
        assert ok[0]
        scores = reference_scores(cosine_matrix(p), v.tolist(), selected=[])
        assert_farthest(int(idx[0]), scores, p)


@contextlib.contextmanager
def cosine_path(gram: bool):
    """Forces FPS's pairwise-cosine matrix (small N) or its pass per pick (large N)."""
    before = query_selection._GRAM_MAX_POINTS
    query_selection._GRAM_MAX_POINTS = 1 << 30 if gram else 0
    try:
        yield
    finally:
        query_selection._GRAM_MAX_POINTS = before


@pytest.mark.parametrize("gram", [True, False], ids=["pairwise", "per-pick"])
@FAST
@given(case=fps_cases())
def test_each_pick_is_brute_force_farthest(gram, case):
    points, k, valid = case
    with cosine_path(gram):
        assert_matches_brute_force(points, valid, *farthest_point_sampling(points, k, valid))


@FAST
@given(fps_cases(), st.integers(0, 2**32 - 1))
def test_power_of_two_scaling_gives_identical_selection(case, seed):
    # Scaling by powers of two is exact in floating point, so even near-ties must not move.
    points, k, valid = case
    g = torch.Generator().manual_seed(seed)
    scale = 2.0 ** torch.randint(-8, 9, (*points.shape[:-1], 1), generator=g)
    scaled = farthest_point_sampling(points * scale.to(points.dtype), k, valid)
    plain = farthest_point_sampling(points, k, valid)
    assert torch.equal(scaled[0], plain[0]) and torch.equal(scaled[1], plain[1])


@FAST
@given(fps_cases(), st.integers(0, 2**32 - 1))
def test_positive_scaling_keeps_selection_farthest(case, seed):
    # Arbitrary positive per-point scales: the picks stay farthest for the *unscaled* points (up
    # to TOL; scaled duplicates are no longer exact ties, so either copy may win).
    points, k, valid = case
    points = points.double()  # scale without rounding the directions
    g = torch.Generator().manual_seed(seed)
    scale = torch.empty(*points.shape[:-1], 1, dtype=torch.float64)
    scale.uniform_(0.01, 100.0, generator=g)
    selection = farthest_point_sampling(points * scale, k, valid)
    assert_matches_brute_force(points, valid, *selection, exact_ties=False)


# --- FPS: ties and corner cases ----------------------------------------------------------------


def test_hand_computed_example_breaks_ties_low():
    # Mean cosines (0.25, 0.25, 0.25, -0.25): seed 3. Max cosine to {3}: (-1, 0, -1): 0 beats 2.
    # Max cosine to {3, 0}: (p1: 0, p2: 1): 1, then 2.
    points = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [-1.0, 0.0]])
    indices, selected_valid = farthest_point_sampling(points, 4)
    assert indices.tolist() == [3, 0, 1, 2]
    assert selected_valid.all()


def test_seed_tie_goes_to_lowest_index():
    points = torch.tensor([[0.0, 2.0], [3.0, 0.0]])  # both have mean cosine 0.5
    assert farthest_point_sampling(points, 2)[0].tolist() == [0, 1]


@pytest.mark.parametrize("gram", [True, False], ids=["pairwise", "per-pick"])
@FAST
@given(n_distinct=st.integers(1, 12), d=st.integers(2, 8), seed=st.integers(0, 2**32 - 1))
def test_duplicates_are_picked_lowest_index_first(gram, n_distinct, d, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n_distinct, d, generator=g)
    source = torch.randint(n_distinct, (3 * n_distinct,), generator=g)
    points = torch.cat([base, base[source]])[torch.randperm(4 * n_distinct, generator=g)]
    with cosine_path(gram):
        order = farthest_point_sampling(points, len(points))[0].tolist()
    rank = {index: position for position, index in enumerate(order)}
    for j in range(len(points)):
        for i in range(j):
            if torch.equal(points[i], points[j]):
                assert rank[i] < rank[j], (i, j, order)


def test_zero_vectors_give_no_nan_and_index_order():
    indices, selected_valid = farthest_point_sampling(torch.zeros(2, 5, 3), 5)
    assert indices.tolist() == [[0, 1, 2, 3, 4]] * 2  # every score ties at 0
    assert selected_valid.all()


def test_low_precision_inputs_are_computed_in_float32():
    points = torch.randn(3, 20, 8, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    low = farthest_point_sampling(points, 10)
    high = farthest_point_sampling(points.float(), 10)
    assert torch.equal(low[0], high[0])


def test_k_zero_returns_empty():
    indices, selected_valid = farthest_point_sampling(torch.randn(2, 3, 7, 4), 0)
    assert indices.shape == selected_valid.shape == (2, 3, 0)
    assert indices.dtype == torch.int64 and selected_valid.dtype == torch.bool
    assert farthest_point_sampling(torch.randn(4, 0, 3), 0)[0].shape == (4, 0)


def test_k_above_n_marks_surplus_invalid():
    indices, selected_valid = farthest_point_sampling(torch.randn(3, 2), 5)
    assert sorted(indices[:3].tolist()) == [0, 1, 2]
    assert selected_valid.tolist() == [True, True, True, False, False]
    assert ((indices >= 0) & (indices < 3)).all()


def test_fully_invalid_row_selects_nothing():
    valid = torch.tensor([[True, False, True], [False, False, False]])
    indices, selected_valid = farthest_point_sampling(torch.randn(2, 3, 4), 2, valid)
    assert selected_valid.tolist() == [[True, True], [False, False]]
    assert sorted(indices[0].tolist()) == [0, 2]


@pytest.mark.parametrize(
    ("shape", "k", "valid_shape", "match"),
    [
        ((5, 3), -1, None, "k=-1"),
        ((5,), 1, None, r"shape \(5,\)"),
        ((2, 5, 3), 2, (2, 4), r"\(2, 5\).*\(2, 4\)"),
        ((0, 3), 1, None, "k=1.*N=0"),
    ],
)
def test_invalid_arguments_raise(shape, k, valid_shape, match):
    valid = None if valid_shape is None else torch.ones(valid_shape, dtype=torch.bool)
    with pytest.raises(PolicyConfigError, match=match):
        farthest_point_sampling(torch.randn(shape), k, valid)


def test_non_bool_mask_raises():
    with pytest.raises(PolicyConfigError, match="bool"):
        farthest_point_sampling(torch.randn(5, 3), 2, torch.ones(5))


def test_compiles_without_graph_breaks():
    # fullgraph=True fails on host syncs (.item()) and data-dependent shapes.
    points = torch.randn(2, 3, 12, 8, dtype=torch.bfloat16)
    valid = torch.rand(2, 3, 12) > 0.3
    compiled = torch.compile(farthest_point_sampling, fullgraph=True, backend="eager")
    expected = farthest_point_sampling(points, 5, valid)
    got = compiled(points, 5, valid)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# --- selectors and the factory ------------------------------------------------------------------


def test_fps_is_one_selector_and_the_memory_model_is_beacon_kv_s_setting():
    points = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(1))
    expected = farthest_point_sampling(points, 6)
    assert isinstance(FPS(), QuerySelector) and torch.equal(FPS().select(points, 6)[0], expected[0])
    assert BeaconKV(128).query_memory == "bounded" and type(BeaconKV(128).sampler) is FPS
    assert type(BeaconKV(128, query_memory="history").lifecycle).__name__ == "QueryHistory"
    assert type(BeaconKV(128).lifecycle).__name__ == "BoundedObservation"
    with pytest.raises(PolicyConfigError, match="query_memory"):
        BeaconKV(128, query_memory="naive")


def test_the_former_module_name_still_imports_with_a_warning():
    import importlib
    import sys

    sys.modules.pop("beaconkv.policies.samplers", None)
    with pytest.warns(DeprecationWarning, match="query_selection"):
        old = importlib.import_module("beaconkv.policies.samplers")
    assert old.QuerySampler is QuerySelector and old.make_sampler is make_selector and old.FPS is FPS
    assert not hasattr(old, "ContinualFPS")


def test_selectors_are_accepted_as_strings_as_schedules_are():
    assert parse_selector("kmeans:n_iter=2,seed=3") == KMeans(n_iter=2, seed=3)
    assert BeaconKV(128, sampler="kmeans:n_iter=2").sampler == KMeans(n_iter=2)
    assert BeaconKV(128, sampler="fps").sampler == FPS()
    with pytest.raises(PolicyConfigError, match="unknown sampler 'kmedoids'"):
        BeaconKV(128, sampler="kmedoids")


def clustered_directions(seed: int, dim: int = 8, n_clusters: int = 4):
    """Points around `n_clusters` orthogonal directions, shuffled; returns (points, labels)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(dim, dim, generator=g))[0]
    centres = q[:n_clusters]  # orthonormal rows
    sizes = torch.randint(3, 10, (n_clusters,), generator=g)
    labels = torch.repeat_interleave(torch.arange(n_clusters), sizes)
    radius = torch.empty(len(labels), 1).uniform_(0.5, 3.0, generator=g)
    points = radius * (centres[labels] + 0.05 * torch.randn(len(labels), dim, generator=g))
    order = torch.randperm(len(labels), generator=g)
    return points[order], labels[order]


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 1000))
def test_kmeans_finds_one_point_per_cluster(data_seed, kmeans_seed):
    points, labels = clustered_directions(data_seed)
    sampler = KMeans(seed=kmeans_seed)
    indices, selected_valid = sampler.select(points, 4)
    assert selected_valid.all()
    assert ((indices >= 0) & (indices < len(points))).all()
    assert len(set(indices.tolist())) == 4
    assert sorted(labels[indices].tolist()) == [0, 1, 2, 3]
    again = sampler.select(points, 4)
    assert torch.equal(indices, again[0]) and torch.equal(selected_valid, again[1])


def test_kmeans_is_batched_over_leading_dims():
    batch = [clustered_directions(seed) for seed in range(3)]
    n = min(len(p) for p, _ in batch)
    points = torch.stack([p[:n] for p, _ in batch])  # (3, n, 8)
    together = KMeans().select(points, 4)
    for b in range(3):
        alone = KMeans().select(points[b], 4)
        assert torch.equal(together[1][b], alone[1])
        picked = together[0][b][together[1][b]]
        assert sorted(picked.tolist()) == sorted(alone[0][alone[1]].tolist())


def test_kmeans_rejects_bad_options():
    with pytest.raises(PolicyConfigError, match="n_iter=-1"):
        KMeans(n_iter=-1)


@pytest.mark.parametrize(
    ("name", "cls"),
    [("fps", FPS), ("FPS", FPS), ("KMeans", KMeans)],
)
def test_make_selector_by_name(name, cls):
    selector = make_selector(name)
    assert type(selector) is cls
    assert selector.name in SELECTOR_NAMES


def test_make_selector_passes_options():
    assert make_selector("kmeans", n_iter=3, seed=7) == KMeans(n_iter=3, seed=7)


@pytest.mark.parametrize("name", ["fsp", "", "k-means", None, "continual_fps"])
def test_make_selector_rejects_unknown_names(name):
    with pytest.raises(PolicyConfigError, match="unknown query selector") as error:
        make_selector(name)
    assert repr(name) in str(error.value)
    assert all(choice in str(error.value) for choice in SELECTOR_NAMES)



def test_kmeans_selection_of_a_row_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    pts = torch.randn(5, 3, 20, 8, generator=g)
    together, _ = KMeans().select(pts, 4)
    alone = torch.stack([KMeans().select(pts[i], 4)[0] for i in range(5)])
    assert torch.equal(together, alone)
