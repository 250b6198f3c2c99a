"""Few-shot linear evaluation (paper §4.1; big_vision's evaluators/fewshot_lsr.py): regularised
least squares from the frozen features of k training images per class to {-1, 1}^K targets,
solved in closed form, scored by top-1 accuracy on the test split.

For seed s and k shots: each class's training indices are permuted with
numpy.random.default_rng(s) and the first k taken; the features are standardised per dimension
with the k-shot subset's mean and std (+1e-5); a constant feature of 100 is appended (a bias
that the penalty barely touches); targets are 2 one_hot(y) - 1; the weights are
(XᵀX + λI)⁻¹XᵀY, or Xᵀ(XXᵀ + λI)⁻¹Y when there are fewer images than dimensions (the same
weights, a smaller system); the prediction is the argmax. All in float64."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vitlab.data import DatasetError
from vitlab.eval.features import Extractor, Features, train_and_test
from vitlab.models.indices import at_least, whole_number

BIAS_CONSTANT = 100.0
STD_EPS = 1e-5
DEFAULT_SHOTS = (1, 5, 10, 25)
DEFAULT_SEEDS = 3
DEFAULT_L2 = 2.0**10


def kshot_indices(labels: np.ndarray, shots: int, seed: int, classes: Sequence[str]) -> np.ndarray:
    """Indices of `shots` training images of each class, classes in index order: class c's
    indices permuted by one numpy.random.default_rng(seed), the first `shots` taken. Since the
    draw only depends on the seed, a k-shot subset holds every smaller one of the same seed."""
    rng = np.random.default_rng(seed)
    picked = []
    for c, name in enumerate(classes):
        own = np.flatnonzero(labels == c)
        if len(own) < shots:
            raise DatasetError(
                f"class {c} ({name!r}) has {len(own)} training image(s), fewer than {shots} shots"
            )
        picked.append(rng.permutation(own)[:shots])
    return np.concatenate(picked)


def design(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """(N, D) features -> (N, D + 1): standardised, the constant BIAS_CONSTANT appended."""
    z = (np.asarray(x, dtype=np.float64) - mean) / std
    return np.concatenate([z, np.full((len(z), 1), BIAS_CONSTANT)], axis=1)


@dataclass
class RidgeFit:
    """A closed-form least-squares classifier with the standardisation it was fitted with."""

    mean: np.ndarray  # (D,)
    std: np.ndarray  # (D,), + STD_EPS
    weights: np.ndarray  # (D + 1, K), the last row the bias

    def scores(self, x: np.ndarray) -> np.ndarray:
        """(N, D) features -> (N, K) regression outputs."""
        return design(x, self.mean, self.std) @ self.weights

    def predict(self, x: np.ndarray) -> np.ndarray:
        """(N, D) features -> (N,) class indices."""
        return self.scores(x).argmax(axis=1)


def check_l2(l2: float) -> None:
    if not 0 < l2 < float("inf"):  # NaN too
        raise ValueError(f"l2 must be a positive finite number, got {l2}")


def fit_ridge(x: np.ndarray, y: np.ndarray, num_classes: int, l2: float) -> RidgeFit:
    """Least squares from features `x` (N, D) to targets 2 one_hot(y) - 1 with penalty
    l2 ||W||², the features standardised with their own mean and std."""
    check_l2(l2)
    x = np.asarray(x, dtype=np.float64)
    mean, std = x.mean(axis=0), x.std(axis=0) + STD_EPS
    a = design(x, mean, std)  # (N, D + 1)
    t = 2.0 * np.eye(num_classes)[np.asarray(y)] - 1.0  # (N, K)
    n, d = a.shape
    if n >= d:
        w = np.linalg.solve(a.T @ a + l2 * np.eye(d), a.T @ t)  # (D + 1, K)
    else:
        w = a.T @ np.linalg.solve(a @ a.T + l2 * np.eye(n), t)  # (D + 1, N) @ (N, K)
    return RidgeFit(mean, std, w)


def check_shots(shots: Sequence[int], seeds: int, labels: np.ndarray, classes: Sequence[str]):
    """A ValueError for a shot count below 1, no seeds, or a class with too few images."""
    if not shots or min(shots) < 1:
        raise ValueError(f"shots must be positive numbers of images per class, got {list(shots)}")
    if seeds < 1:
        raise ValueError(f"seeds must be at least 1, got {seeds}")
    counts = np.bincount(labels, minlength=len(classes))
    short = [(c, n) for c, n in enumerate(counts) if n < max(shots)]
    if short:
        names = ", ".join(f"{classes[c]!r} ({n})" for c, n in short[:8])
        names += ", ..." if len(short) > 8 else ""
        raise DatasetError(
            f"{max(shots)} shots need {max(shots)} training images of every class; "
            f"{len(short)} class(es) have fewer: {names}"
        )


def kshot_accuracies(
    features: Callable[[np.ndarray], np.ndarray],
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    shots: int,
    seeds: int,
    classes: Sequence[str],
    l2: float,
) -> list[float]:
    """Test top-1 of the `shots`-shot ridge classifier for draws 0..seeds-1. `features(idx)` gives
    the (k, D) float64 features of the drawn training images, so a caller can compute only those."""
    accs = []
    for seed in range(seeds):
        idx = kshot_indices(y_train, shots, seed, classes)
        fit = fit_ridge(features(idx), y_train[idx], len(classes), l2)
        accs.append(float((fit.predict(x_test) == y_test).mean()))
    return accs


def drawable(train: Features, shots: int, seeds: int) -> Features:
    """`train` as the draws take it: by every listed image's label, where each image a draw takes
    decoded; else (a drawn image did not decode) the images that decoded alone, drawn by their
    labels. The same either way whether the features are the drawn rows' or the whole split's,
    cached or not."""
    if train.rows is None or len(train.labels) == len(train):  # every row is there
        return train
    labels = train.labels.numpy()
    drawn = np.concatenate([kshot_indices(labels, shots, s, train.classes) for s in range(seeds)])
    if np.isin(drawn, train.rows.numpy()).all():
        return train
    return Features(train.x, train.y, train.classes, train.cache, train.cached)


def fewshot(
    train: Features,
    test: Features,
    shots: Sequence[int] = DEFAULT_SHOTS,
    seeds: int = DEFAULT_SEEDS,
    l2: float = DEFAULT_L2,
) -> list[dict[str, Any]]:
    """Test top-1 of the k-shot classifier for every k in `shots` and seeds 0..seeds-1: one
    {"shots", "mean", "std" (over seeds, ddof 0), "per_seed"} per k."""
    check_shots(shots, seeds, train.labels.numpy(), train.classes)
    train = drawable(train, max(shots), seeds)
    y_train = train.labels.numpy()
    check_shots(shots, seeds, y_train, train.classes)
    x_test, y_test = test.x.double().numpy(), test.y.numpy()
    results = []
    for k in shots:
        accs = kshot_accuracies(lambda idx: train.at(idx).double().numpy(), y_train, x_test,
                                y_test, k, seeds, train.classes, l2)  # fmt: skip
        results.append(
            {"shots": k, "mean": float(np.mean(accs)), "std": float(np.std(accs)), "per_seed": accs}
        )
    return results


def fewshot_checkpoint(
    source: str,
    data: str | None = None,
    data_dir: str | None = None,
    shots: int | Sequence[int] = DEFAULT_SHOTS,
    seeds: int = DEFAULT_SEEDS,
    l2: float = DEFAULT_L2,
    features: str = "prelogits",
    batch_size: int = 256,
    device: str = "auto",
    cache_dir: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The few-shot report of a checkpoint on a dataset: its results and the protocol. `shots`:
    shot counts (a list, or one number)."""
    one = whole_number(shots)  # numpy's too; a list's entries as whole numbers (3.5 refused)
    shots = [one] if one is not None else [at_least(k, 1, "shots") for k in shots]
    check_l2(l2)  # before any feature is extracted
    check_shots(shots, seeds, np.zeros(0, dtype=np.int64), [])
    extractor = Extractor(source, features, device, batch_size, cache_dir, progress)

    def drawn(labels: np.ndarray, classes: list[str]) -> np.ndarray:
        """The training images some draw takes: only those are extracted."""
        check_shots(shots, seeds, labels, classes)
        return np.concatenate([kshot_indices(labels, max(shots), s, classes) for s in range(seeds)])

    train, test, about = train_and_test(extractor, data, data_dir, drawn)
    results = fewshot(train, test, shots, seeds, l2)
    protocol = {
        "shots": list(shots),
        "seeds": list(range(seeds)),
        "l2": l2,
        "features": features,
        "draw": "each class's training indices permuted by numpy.random.default_rng(seed), "
        "first k taken",
        "standardisation": f"per dimension, the k-shot subset's mean and std (+{STD_EPS:g})",
        "bias_constant": BIAS_CONSTANT,
        "targets": "2 * one_hot(y) - 1",
        "solver": "closed-form regularised least squares in float64",
        "metric": "test top-1 accuracy; mean and std (ddof 0) over seeds",
    }
    return {**about, "protocol": protocol, "results": results}


def format_fewshot(report: dict[str, Any]) -> str:
    """The report as a table."""
    p = report["protocol"]
    used = report["train_images_extracted"]
    drawn = f" ({used:,} drawn)" if used < report["num_train_images"] else ""
    lines = [
        f"{report['checkpoint'] or report['source']} on {report['data']}: few-shot linear "
        f"({report['features']} features, D={report['feature_dim']}, l2={p['l2']:g}, "
        f"{len(p['seeds'])} seed(s))",
        f"{report['num_train_images']:,} train{drawn} / {report['num_test_images']:,} test "
        f"images, {report['num_classes']} classes",
        "",
        f"{'shots':>5}  {'top-1':>7}  {'std':>6}  per seed",
    ]
    for r in report["results"]:
        seeds = " ".join(f"{100 * a:.2f}" for a in r["per_seed"])
        lines.append(f"{r['shots']:>5}  {100 * r['mean']:6.2f}%  {100 * r['std']:5.2f}%  {seeds}")
    return "\n".join(lines)
