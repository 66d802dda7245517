"""Numerics of the fid package without Inception: Fréchet distance, streamed statistics,
Inception Score and precision/recall, each against an independent reference."""

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _fid_reference import numpy_inception_score, self_distance_tolerance
from fid import FeatureMoments, Gaussian, frechet_distance, inception_score, precision_recall
from fid.manifolds import manifold_radii
from fid.moments import gaussian_of


def random_gaussian(rng: np.random.Generator, dim: int, samples: int, shift: float = 0.0) -> Gaussian:
    """Statistics of `samples` correlated feature vectors; rank-deficient when samples <= dim."""
    mixing = rng.normal(size=(dim, dim)) / np.sqrt(dim)
    x = rng.normal(size=(samples, dim)) @ mixing + shift + rng.uniform(size=dim)
    return Gaussian(x.mean(0), np.cov(x, rowvar=False))


def sqrtm_frechet(a: Gaussian, b: Gaussian) -> float:
    """The textbook formula with scipy's general matrix square root (what TTUR/pytorch-fid use)."""
    covmean = scipy.linalg.sqrtm(a.cov @ b.cov).real
    diff = a.mean - b.mean
    return float(diff @ diff + np.trace(a.cov) + np.trace(b.cov) - 2 * np.trace(covmean))


# ----------------------------------------------------------------------------------------------
# Fréchet distance
# ----------------------------------------------------------------------------------------------


def test_frechet_matches_scipy_sqrtm_full_rank():
    rng = np.random.default_rng(0)
    a, b = random_gaussian(rng, 96, 2000), random_gaussian(rng, 96, 2000, shift=0.3)
    # Both are float64 evaluations of the same trace on well-conditioned matrices: they agree to
    # round-off (~1e-12 observed); 1e-6 is the bound.
    assert frechet_distance(a, b) == pytest.approx(sqrtm_frechet(a, b), rel=1e-6)


def test_frechet_matches_scipy_sqrtm_rank_deficient():
    rng = np.random.default_rng(1)
    a, b = random_gaussian(rng, 128, 50), random_gaussian(rng, 128, 60, shift=0.2)  # fewer samples than dims
    # Near-zero eigenvalues: eigh clips round-off negatives to 0, sqrtm keeps complex round-off whose
    # square roots (~1e-8 each) add up; the issue bounds the difference at 1e-4 relative.
    assert frechet_distance(a, b) == pytest.approx(sqrtm_frechet(a, b), rel=1e-4)


def test_frechet_closed_form_scalar_times_identity():
    # With S_a = c I, tr (S_a S_b)^(1/2) = sqrt(c) * sum_i sqrt(lambda_i(S_b)) for any S_b.
    rng = np.random.default_rng(2)
    dim, c = 64, 2.5
    q, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
    eigenvalues = rng.uniform(0.1, 3.0, size=dim)
    a = Gaussian(rng.normal(size=dim), c * np.eye(dim))
    b = Gaussian(rng.normal(size=dim), (q * eigenvalues) @ q.T)
    expected = (
        np.sum((a.mean - b.mean) ** 2) + c * dim + eigenvalues.sum() - 2 * np.sqrt(c) * np.sqrt(eigenvalues).sum()
    )
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-10)  # float64 round-off only


def test_frechet_closed_form_diagonal():
    # Commuting (diagonal) covariances: the distance is |mu_a - mu_b|^2 + sum (sqrt(a_i) - sqrt(b_i))^2.
    rng = np.random.default_rng(3)
    var_a, var_b = rng.uniform(0.0, 2.0, 50), rng.uniform(0.0, 2.0, 50)
    var_a[:5] = 0.0  # singular covariance: zero-variance directions are allowed
    a, b = Gaussian(rng.normal(size=50), np.diag(var_a)), Gaussian(rng.normal(size=50), np.diag(var_b))
    expected = np.sum((a.mean - b.mean) ** 2) + np.sum((np.sqrt(var_a) - np.sqrt(var_b)) ** 2)
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-10)


def test_frechet_of_a_set_with_itself_is_zero():
    rng = np.random.default_rng(4)
    a = random_gaussian(rng, 256, 100)  # rank 99 of 256, like a small FID run
    # 2 tr S - 2 tr S up to the square roots of round-off eigenvalues (see self_distance_tolerance).
    assert abs(frechet_distance(a, a)) <= self_distance_tolerance(a.cov)


def test_frechet_of_a_set_with_known_rows_is_a_nuclear_norm():
    # S_b = FᵀF (F: 12 rows, 300-d) against a full-rank S_a = Q diag(l) Qᵀ: tr (S_a S_b)^(1/2) is the sum of the
    # singular values of F S_a^(1/2), computed here by an SVD (the fast path solves F S_a Fᵀ's eigenvalues instead).
    rng = np.random.default_rng(6)
    dim, n = 300, 12
    q, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
    eigenvalues = rng.uniform(0.1, 3.0, size=dim)
    rows = rng.normal(size=(n, dim)) / 4
    a = Gaussian(rng.normal(size=dim), (q * eigenvalues) @ q.T)
    b = Gaussian(rng.normal(size=dim), rows.T @ rows, rows)
    nuclear = np.linalg.svd(rows @ (q * np.sqrt(eigenvalues)) @ q.T, compute_uv=False).sum()
    expected = np.sum((a.mean - b.mean) ** 2) + np.trace(a.cov) + np.trace(b.cov) - 2 * nuclear
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-10)  # float64 round-off only
    assert frechet_distance(b, a) == pytest.approx(expected, rel=1e-10)  # either side may know its rows


def test_frechet_with_rows_equals_the_dense_path():
    # Streamed statistics of fewer vectors than dimensions keep their rows; the distance is the dense path's up to
    # the square roots of the dense path's round-off eigenvalues (self_distance_tolerance's reason), ~1e-8 here.
    rng = np.random.default_rng(7)
    mixing = rng.normal(size=(256, 256)) / 16
    small = np.abs(rng.normal(size=(20, 256)) @ mixing + 0.3)
    large = np.abs(rng.normal(size=(200, 256)) @ mixing + 0.4)
    with_rows = [gaussian_of(small), gaussian_of(large)]
    assert [gaussian.rows.shape for gaussian in with_rows] == [(20, 256), (200, 256)]
    dense = [Gaussian(gaussian.mean, gaussian.cov) for gaussian in with_rows]
    np.testing.assert_allclose(with_rows[0].rows.T @ with_rows[0].rows, dense[0].cov, rtol=0, atol=1e-12)
    assert frechet_distance(*with_rows) == pytest.approx(frechet_distance(*dense), rel=1e-6)
    assert frechet_distance(with_rows[0], dense[1]) == pytest.approx(frechet_distance(*dense), rel=1e-6)


def test_streamed_moments_keep_rows_only_while_they_are_no_more_than_the_dimensions():
    rng = np.random.default_rng(8)
    moments, other = FeatureMoments(8), FeatureMoments(8)
    moments.update(rng.normal(size=(5, 8)))
    other.update(rng.normal(size=(3, 8)))
    assert moments.merge(other).gaussian().rows.shape == (8, 8)  # 8 vectors of 8 dimensions: kept
    other.update(rng.normal(size=(1, 8)))
    assert moments.merge(other).gaussian().rows is None  # 9: the covariance alone
    moments.update(rng.normal(size=(4, 8)))
    assert moments.gaussian().rows is None  # and once dropped, never back
    assert FeatureMoments.from_packed(other.packed(), 8).gaussian().rows is None  # a sum across processes


def test_frechet_rejects_mismatched_dimensions():
    rng = np.random.default_rng(5)
    with pytest.raises(ValueError, match="64-d and 32-d"):
        frechet_distance(random_gaussian(rng, 64, 100), random_gaussian(rng, 32, 100))


# ----------------------------------------------------------------------------------------------
# Streamed statistics
# ----------------------------------------------------------------------------------------------


def _features(seed: int = 0) -> np.ndarray:
    # Non-negative, offset features like pool_3 (mean ~ std): the case where sum x x^T loses digits.
    rng = np.random.default_rng(seed)
    return np.abs(rng.normal(0.4, 0.5, size=(1003, 48)) @ rng.normal(size=(48, 48)) / 7 + 2.0)


def _assert_matches_np_cov(gaussian: Gaussian, features: np.ndarray) -> None:
    # float64 sums over ~1000 vectors: round-off ~1e-13 relative; 1e-9 leaves room and still
    # catches an N vs N - 1 normalisation (1e-3) or a float32 accumulation (1e-7).
    cov = np.cov(features, rowvar=False)  # two-pass reference
    np.testing.assert_allclose(gaussian.mean, features.mean(0), rtol=1e-9, atol=0)
    np.testing.assert_allclose(gaussian.cov, cov, rtol=0, atol=1e-9 * np.abs(cov).max())


def test_streamed_moments_over_uneven_batches_match_np_cov():
    features = _features()
    moments = FeatureMoments(features.shape[1])
    for batch in np.array_split(features, [1, 2, 50, 51, 400, 777]):  # sizes 1, 1, 48, 1, 349, 377, 226
        moments.update(torch.from_numpy(batch))
    assert moments.count == len(features)
    _assert_matches_np_cov(moments.gaussian(), features)


def test_merged_and_packed_moments_match_np_cov():
    features = _features(1)
    first, second = FeatureMoments(48), FeatureMoments(48)
    first.update(torch.from_numpy(features[:300]))
    second.update(torch.from_numpy(features[300:]))
    merged = first.merge(second)
    _assert_matches_np_cov(merged.gaussian(), features)
    summed = FeatureMoments.from_packed(first.packed() + second.packed(), 48)  # what an all-reduce does
    _assert_matches_np_cov(summed.gaussian(), features)


def _distributed_worker(rank: int, world_size: int, init_file: str, result_file: str) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool (as DataLoader workers)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    features = _features(2)
    share = np.array_split(features, [700])[rank]  # uneven shares: 700 and 303 vectors
    moments = FeatureMoments(features.shape[1])
    for batch in np.array_split(share, 5):
        moments.update(torch.from_numpy(batch))
    gaussian = moments.all_reduce().gaussian()
    np.savez(f"{result_file}.{rank}.npz", mean=gaussian.mean, cov=gaussian.cov)
    dist.destroy_process_group()


def test_moments_all_reduced_over_two_processes_match_np_cov(tmp_path):
    # fork, not spawn: spawned children would re-import torch (~10 s each on the shared CI cores)
    mp.start_processes(
        _distributed_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "result")), nprocs=2, start_method="fork"
    )
    features = _features(2)
    for rank in range(2):
        with np.load(tmp_path / f"result.{rank}.npz") as result:
            _assert_matches_np_cov(Gaussian(result["mean"], result["cov"]), features)


def test_moments_need_two_vectors():
    moments = FeatureMoments(4)
    moments.update(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="at least 2"):
        moments.gaussian()
    with pytest.raises(ValueError, match=r"expected features \(B, 4\)"):
        moments.update(torch.zeros(3, 5))


# ----------------------------------------------------------------------------------------------
# Inception Score
# ----------------------------------------------------------------------------------------------


def test_inception_score_matches_numpy_with_a_partial_last_split():
    logits = np.random.default_rng(6).normal(0, 3, size=(250, 1008))
    # Same float64 formula, different association order (log-softmax vs log of softmax): ~1e-14.
    assert inception_score(logits, split_size=100) == pytest.approx(numpy_inception_score(logits, 100), rel=1e-10)


def test_inception_score_extremes():
    # Confident, evenly spread predictions over C classes score C; identical predictions score 1.
    classes = 10
    confident = 50.0 * np.eye(classes)[np.arange(200) % classes]  # (200, 10)
    assert inception_score(confident, split_size=100) == pytest.approx(classes, rel=1e-6)
    assert inception_score(np.zeros((200, classes)), split_size=100) == pytest.approx(1.0, abs=1e-12)


def test_inception_score_needs_one_full_split():
    with pytest.raises(ValueError, match="splits of 5000 samples; got only 4999"):
        inception_score(np.zeros((4999, 1008)))


# ----------------------------------------------------------------------------------------------
# Precision / recall
# ----------------------------------------------------------------------------------------------


def test_precision_recall_identical_sets_are_one():
    x = torch.randn(200, 32, generator=torch.Generator().manual_seed(7))
    assert precision_recall(x, x.clone()) == (1.0, 1.0)


def test_precision_recall_far_apart_sets_are_zero():
    x = torch.randn(200, 32, generator=torch.Generator().manual_seed(8))
    assert precision_recall(x, x + 100.0) == (0.0, 0.0)


def test_precision_recall_hand_computed():
    # References on a line, k = 3. Distances to the 3rd nearest other reference:
    # 0 -> 3, 1 -> 2, 2 -> 2, 3 -> 3, 10 -> 9, i.e. balls [-3, 3], [-1, 3], [0, 4], [0, 6], [1, 19].
    ref = torch.tensor([[0.0], [1.0], [2.0], [3.0], [10.0]])
    np.testing.assert_allclose(manifold_radii(ref, k=3).sqrt().numpy(), [3, 2, 2, 3, 9], atol=1e-4)

    # Samples 2.5 (in 0's ball), 5 (in 3's), 21 (none: 10's ends at 19), -2 (in 0's), 30 (none): precision 3/5.
    # Their own radii: -2 -> 23, 2.5 -> 18.5, 5 -> 16, 21 -> 18.5, 30 -> 27.5; -2's ball [-25, 21]
    # holds every reference: recall 5/5.
    samples = torch.tensor([[2.5], [5.0], [21.0], [-2.0], [30.0]])
    assert precision_recall(ref, samples, k=3) == pytest.approx((3 / 5, 5 / 5))

    # Samples 2.5, 2.6, 2.7, 2.8 (in 0's ball) and 30 (none): precision 4/5. Their radii 0.3, 0.2,
    # 0.2, 0.3, 27.4 give balls [2.2, 2.8], [2.4, 2.8], [2.5, 2.9], [2.5, 3.1], [2.6, 57.4]: only the
    # references 3 and 10 are covered, recall 2/5.
    samples = torch.tensor([[2.5], [2.6], [2.7], [2.8], [30.0]])
    assert precision_recall(ref, samples, k=3) == pytest.approx((4 / 5, 2 / 5))

    # A point on a ball's boundary is inside (ADM compares with <=): -3 lies exactly on 0's ball,
    # -3.5, -4 and -5 outside every ball. Squares of small integers are exact in float32.
    samples = torch.tensor([[-3.0], [-3.5], [-4.0], [-5.0]])
    assert precision_recall(ref, samples, k=3)[0] == pytest.approx(1 / 4)


def test_precision_recall_batched_equals_unbatched():
    generator = torch.Generator().manual_seed(9)
    ref, samples = torch.randn(300, 16, generator=generator), torch.randn(250, 16, generator=generator) + 0.5
    assert precision_recall(ref, samples, row_batch=7) == precision_recall(ref, samples, row_batch=10_000)


def test_precision_recall_needs_more_points_than_k():
    with pytest.raises(ValueError, match="more than 3 sample images, got 3"):
        precision_recall(torch.randn(10, 4), torch.randn(3, 4))


def test_gaussian_of_features_in_memory_is_numpy_mean_and_cov():
    from fid import gaussian_of

    features = np.random.default_rng(3).normal(size=(50, 6))
    gaussian = gaussian_of(features)
    np.testing.assert_allclose(gaussian.mean, features.mean(axis=0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(gaussian.cov, np.cov(features, rowvar=False), rtol=0, atol=1e-12)  # N - 1, float64


def test_the_fid_of_a_set_with_itself_is_zero_not_minus_zero():
    import numpy as np

    from fid import gaussian_of
    from fid.frechet import frechet_distance

    # 50 samples of 64 features: a singular covariance, whose traces' round-off left -3.9e-7 (printed -0.0000)
    features = np.random.default_rng(0).normal(size=(50, 64))
    same = gaussian_of(features)
    assert f"{frechet_distance(same, same):.4f}" == "0.0000"
