"""The reference of every digits FID: the Inception pool_3 features of scikit-learn's 1797 real digits (the bundled
weights), computed once per user and cached, not committed (14.7 MB of float32 that would be two thirds of the
repository).

They are computed on the CPU in a child process whose ATen and oneDNN kernels are held to AVX2
(`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`): the published scores were measured against features computed on an
AVX2-only CPU, and that code path gives them again bit for bit on an AVX-512 CPU too, where the native kernels round
differently (rows up to 3.0e-6 apart in Euclidean norm). The features are then checked against a small committed
digest (DIGEST): the SHA-256 of the float32 array first; failing that, the rows every SPOT_EVERY-th digit as stored,
every row's norm, the mean and the FID of the two halves, within ROW_TOLERANCE of the stored ones. Only features
that pass are cached, in one atomic write (`<cache>/dit-vca/digits_inception_pool3.npz`, <cache> = $XDG_CACHE_HOME
or ~/.cache), and a cached file is checked the same way whenever it is read.

Why a recomputation within ROW_TOLERANCE moves an FID by little: the square root of FID is the Wasserstein-2
distance between the two Gaussians, a metric, so an FID F against the reference becomes F' with
|sqrt(F') - sqrt(F)| <= W2(reference, recomputed reference); by Gelbrich's bound that is at most the empirical W2,
at most the root mean square of the row distances times sqrt(n / (n - 1)) (the covariance's n - 1). Rows within
ROW_TOLERANCE move every FID by at most 2 sqrt(F) c ROW_TOLERANCE + (c ROW_TOLERANCE)^2, c = sqrt(n / (n - 1)):
`fid_bound`. Only the bit-identical path reproduces every published figure exactly; the other is said in one line.

    python -m judges.digits_reference --out FILE [--every K]   # the child process: the features of every K-th digit
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import platform
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from commands import UserError

DIGEST = Path(__file__).resolve().parent / "digits_inception_pool3_digest.npz"
CACHE_NAME = "digits_inception_pool3.npz"
SPOT_EVERY = 43  # the digest's spot rows: every 43rd digit, 42 rows, every class among them
# The largest row distance a recomputation may have from the stored features: 3.3x the largest measured between two
# code paths (AVX-512 kernels against the AVX2 ones that made them: 3.0e-6 over all 1797 rows; an SSE4.1-only path
# measured 6.5e-5 on the spot rows and is refused). A wrong recomputation (other weights, resizing or row order) moves
# rows by more than 1 (row norms are 18-27).
ROW_TOLERANCE = 1e-5
# The kernels the stored features were computed with, on x86-64 CPUs (see the module's docstring).
KERNEL_ENVIRONMENT = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


class ReferenceMismatchError(UserError):
    """Features computed here that are not the reference: FIDs against them would not compare with the published.
    A command that scores digits (demo.py, the studies) stops with this one line, before it scores anything."""


@dataclass(frozen=True)
class Digest:
    """What is committed of the reference features: enough to recognise them, not to replace them."""

    weights: str  # the Inception weights' description (fid.load_inception("bundled").weights.description)
    sha256: str  # of the (1797, 2048) float32 array, C order
    spot_pool: np.ndarray  # (42, 2048) float32: the rows of every SPOT_EVERY-th digit
    row_norms: np.ndarray  # (1797,) float64: every row's Euclidean norm
    mean: np.ndarray  # (2048,) float64
    halves_fid: float  # FID between the even and the odd rows (docs/demo.md: "two halves ... 9.55 FID apart")

    @classmethod
    def load(cls, path: Path = DIGEST) -> Digest:
        with np.load(path) as stored:
            return cls(
                str(stored["weights"]),
                str(stored["sha256"]),
                stored["spot_pool"],
                stored["row_norms"],
                stored["mean"],
                float(stored["halves_fid"]),
            )

    @classmethod
    def of(cls, pool: np.ndarray, weights: str) -> Digest:
        """The digest of float32 features (N, 2048)."""
        pool = np.ascontiguousarray(pool, dtype=np.float32)
        wide = pool.astype(np.float64)
        return cls(
            weights,
            hashlib.sha256(pool.tobytes()).hexdigest(),
            pool[::SPOT_EVERY].copy(),
            np.linalg.norm(wide, axis=1),
            wide.mean(axis=0),
            halves_fid(wide),
        )

    def save(self, path: Path) -> None:
        from atomic_files import save_npz_atomic

        save_npz_atomic(
            path,
            weights=np.array(self.weights),
            sha256=np.array(self.sha256),
            spot_pool=self.spot_pool,
            row_norms=self.row_norms,
            mean=self.mean,
            halves_fid=np.array(self.halves_fid),
        )


def halves_fid(pool: np.ndarray) -> float:
    """FID between the even and the odd rows: what FID reads for two sets of real digits of about this size."""
    from fid import frechet_distance, gaussian_of

    wide = pool.astype(np.float64)
    return frechet_distance(gaussian_of(wide[0::2]), gaussian_of(wide[1::2]))


def fid_bound(fid: float, row_distance: float, rows: int) -> float:
    """The largest change of an FID `fid` when the reference's rows (`rows` of them) move by at most `row_distance`
    each (root mean square): |sqrt(F') - sqrt(F)| <= c d, c = sqrt(rows / (rows - 1)) (module docstring)."""
    shift = math.sqrt(rows / (rows - 1)) * row_distance
    return 2 * math.sqrt(fid) * shift + shift**2


def check(pool: np.ndarray, digest: Digest) -> str:
    """ "exact" when `pool` is the reference bit for bit; "within rounding" when it differs from it no more than
    ROW_TOLERANCE allows; else ReferenceMismatchError, naming what differs."""
    pool = np.ascontiguousarray(pool, dtype=np.float32)
    expected = (len(digest.row_norms), len(digest.mean))
    if pool.shape != expected:
        raise ReferenceMismatchError(f"features of shape {pool.shape}, the reference's {expected}: not the reference")
    if hashlib.sha256(pool.tobytes()).hexdigest() == digest.sha256:
        return "exact"
    wide = pool.astype(np.float64)
    spot = np.linalg.norm(wide[::SPOT_EVERY] - digest.spot_pool, axis=1).max()
    norms = np.abs(np.linalg.norm(wide, axis=1) - digest.row_norms).max()
    mean = np.linalg.norm(wide.mean(axis=0) - digest.mean)
    halves = abs(halves_fid(wide) - digest.halves_fid)
    # Each half moves by at most its rows' distance: twice the bound of one set (module docstring).
    allowed = {"spot rows": ROW_TOLERANCE, "row norms": ROW_TOLERANCE, "mean": ROW_TOLERANCE}
    allowed["halves' FID"] = fid_bound(digest.halves_fid, 2 * ROW_TOLERANCE, len(pool) // 2)
    found = {"spot rows": spot, "row norms": norms, "mean": mean, "halves' FID": halves}
    wrong = [f"{name} {found[name]:.2e} > {limit:.2e}" for name, limit in allowed.items() if found[name] > limit]
    if wrong:
        raise ReferenceMismatchError(
            "the real digits' Inception features computed here are not the reference the published digits FIDs were "
            f"measured against ({'; '.join(wrong)}): another Inception, resizing or row order"
        )
    return "within rounding"


def cache_path() -> Path:
    """<$XDG_CACHE_HOME or ~/.cache>/dit-vca/digits_inception_pool3.npz."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dit-vca" / CACHE_NAME


def compute(every: int = 1) -> np.ndarray:
    """The features (N, 2048) float32 of every `every`-th real digit, computed in a child process in the reference
    code path (KERNEL_ENVIRONMENT on x86-64), with its progress bar."""
    environment = dict(os.environ)
    if platform.machine().lower() in ("x86_64", "amd64"):
        environment |= KERNEL_ENVIRONMENT
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "pool.npz"
        command = [sys.executable, "-m", "judges.digits_reference", "--out", str(out), "--every", str(every)]
        subprocess.run(command, env=environment, check=True, cwd=Path(__file__).resolve().parents[1])
        with np.load(out) as computed:
            return computed["pool"]


def reference_features(digest: Digest | None = None) -> np.ndarray:
    """The reference features (1797, 2048) float32: the cached ones when they pass `check`, else computed (a few CPU
    minutes, once), checked and cached."""
    from atomic_files import save_npz_atomic

    digest = digest or Digest.load()
    path = cache_path()
    if path.is_file():
        try:
            with np.load(path) as cached:
                pool, weights = cached["pool"], str(cached["weights"])
            if weights == digest.weights:
                check(pool, digest)
                return pool
        except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, ReferenceMismatchError):
            pass  # unreadable, cut short or not the reference: computed again below, and replaced
    print(
        "judges: the Inception features of the 1797 real digits, the reference of every digits FID, are computed "
        f"once (a few CPU minutes) and cached in {path}",
        file=sys.stderr,
        flush=True,
    )
    pool = compute()
    if check(pool, digest) != "exact":
        worst = fid_bound(100.0, ROW_TOLERANCE, len(pool))
        print(
            "judges: these features differ from the reference by rounding only (this CPU's kernels); a digits FID "
            f"against them may differ from one against the reference by up to {worst:.1e} (at FID 100)",
            file=sys.stderr,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    save_npz_atomic(path, pool=pool, weights=np.array(digest.weights))
    return pool


def real_digit_features(real_images: np.ndarray, extractor) -> np.ndarray:
    """Inception pool_3 features of real digits (N, 2048), float64.

    All 1797 digits with the bundled weights: the reference every published digits FID was measured against
    (`reference_features`: computed once per user in the code path that made it, checked, cached; a few CPU minutes
    the first time), whatever device `extractor` is on. Any other set or weights: computed with `extractor`.
    """
    from judges.digits import inception_batches, real_digits

    digest = Digest.load()
    if extractor.weights.description == digest.weights and np.array_equal(real_images, real_digits()[0]):
        return reference_features(digest).astype(np.float64)
    from fid import extract_features

    return (
        extract_features(inception_batches(real_images, "real digits"), extractor, keep_pool=True).pool.double().numpy()
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Inception pool_3 features of the real digits (the bundled weights)")
    parser.add_argument("--out", type=Path, required=True, help="the .npz to write (pool, weights)")
    parser.add_argument("--every", type=int, default=1, help="every K-th digit only (a spot check)")
    args = parser.parse_args(argv)
    from atomic_files import save_npz_atomic
    from fid import extract_features, load_inception
    from judges.digits import inception_batches, real_digits

    images = real_digits()[0][:: args.every]
    extractor = load_inception("bundled", device="cpu")
    features = extract_features(inception_batches(images, "real digits"), extractor, keep_pool=True)
    pool = features.pool.numpy().astype(np.float32)
    save_npz_atomic(args.out, pool=pool, weights=np.array(extractor.weights.description))


if __name__ == "__main__":
    main()
