"""Probes of frozen features over the whole training split, scored on the test split.

linear   multinomial logistic regression (L-BFGS) on standardised features; C chosen on a
         held-out 10% of the training features from a log-spaced grid, then refitted on all
knn      cosine k-nearest neighbours as DINO reports it (Caron et al. 2021): L2-normalised
         features, the k most similar training features vote with weight exp(sim / T),
         votes summed per class, argmax (k = 20, T = 0.07)
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from vitlab.data import DatasetError
from vitlab.eval.features import Extractor, Features, train_and_test

log = logging.getLogger(__name__)

KINDS = ("linear", "knn", "both")
C_GRID = tuple(float(c) for c in np.logspace(-3, 1, 5))  # 0.001 ... 10
VAL_FRACTION = 0.1
STD_EPS = 1e-5


# --- linear --------------------------------------------------------------------------------------


def standardise(train: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
    """`train` and `others` standardised per dimension with `train`'s mean and std (+1e-5)."""
    mean, std = train.mean(axis=0), train.std(axis=0) + STD_EPS
    return [(a - mean) / std for a in (train, *others)]


def holdout(n: int, fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(fit, validation) indices: a seeded `fraction` of range(n) held out (at least one)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the validation fraction must be in (0, 1), got {fraction}")
    held = max(1, round(n * fraction))
    if n - held < 1:
        raise DatasetError(f"{n} training image(s) are too few to hold out a validation part")
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[held:]), np.sort(order[:held])


def _logistic(x: np.ndarray, y: np.ndarray, c: float, max_iter: int):
    """A multinomial logistic regression with inverse penalty `c`, fitted by L-BFGS; not
    converging within `max_iter` is a warning, not an error."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(C=c, solver="lbfgs", max_iter=max_iter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        clf.fit(x, y)
    if any(issubclass(w.category, ConvergenceWarning) for w in caught):
        log.warning("L-BFGS did not converge in %d iterations (C=%g)", max_iter, c)
    return clf


def linear_probe(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    grid: Sequence[float] = C_GRID,
    val_fraction: float = VAL_FRACTION,
    seed: int = 0,
    max_iter: int = 1000,
) -> dict[str, Any]:
    """Test top-1 of a logistic regression on (N, D) features: each C of `grid` fitted on the
    training features less a held-out `val_fraction` and scored there, the best C (the
    smallest on a tie) refitted on all of them. {"top1", "C", "grid": [{"C", "val_top1"}]}."""
    x_train, x_test = np.asarray(x_train, np.float64), np.asarray(x_test, np.float64)
    fit, val = holdout(len(y_train), val_fraction, seed)
    a, b = standardise(x_train[fit], x_train[val])
    scores = [float(_logistic(a, y_train[fit], c, max_iter).score(b, y_train[val])) for c in grid]
    best = grid[int(np.argmax(scores))]
    a, b = standardise(x_train, x_test)
    clf = _logistic(a, y_train, best, max_iter)
    return {
        "top1": float(clf.score(b, y_test)),
        "C": best,
        "grid": [{"C": c, "val_top1": s} for c, s in zip(grid, scores)],
        "val_fraction": val_fraction,
        "num_val_images": len(val),
    }


# --- k-NN ----------------------------------------------------------------------------------------


@torch.no_grad()
def knn_scores(
    train_x: Tensor,
    train_y: Tensor,
    test_x: Tensor,
    num_classes: int,
    k: int = 20,
    temperature: float = 0.07,
    chunk: int = 256,
) -> Tensor:
    """(M, num_classes) votes for test features (M, D) from training features (N, D) with labels
    (N,): the k training features of highest cosine similarity each add exp(sim / T) to their
    class. Computed `chunk` test rows at a time (memory chunk x N); every row's weights are
    scaled by exp(-max sim / T), which leaves its argmax as it is and keeps exp() finite."""
    if k < 1 or not 0 < temperature < float("inf"):  # NaN too
        raise ValueError(f"k-NN needs k >= 1 and a temperature > 0, got k={k}, T={temperature}")
    train = F.normalize(train_x.float(), dim=1)  # (N, D)
    labels = train_y.long()
    k = min(k, len(train))
    out = []
    for rows in test_x.float().split(chunk):
        sim = F.normalize(rows, dim=1) @ train.T  # (B, N)
        top, idx = sim.topk(k, dim=1)  # (B, k), most similar first
        weights = ((top - top[:, :1]) / temperature).exp()  # (B, k)
        votes = torch.zeros(len(rows), num_classes, dtype=weights.dtype)
        out.append(votes.scatter_add_(1, labels[idx], weights))  # (B, num_classes)
    return torch.cat(out)


def knn_probe(
    train: Features, test: Features, k: int = 20, temperature: float = 0.07
) -> dict[str, Any]:
    """Test top-1 of the weighted cosine k-NN classifier."""
    votes = knn_scores(train.x, train.y, test.x, len(train.classes), k, temperature)
    top1 = (votes.argmax(dim=1) == test.y).double().mean().item()
    return {"top1": top1, "k": min(k, len(train)), "temperature": temperature}


# --- a checkpoint --------------------------------------------------------------------------------


def probe_checkpoint(
    source: str,
    data: str | None = None,
    data_dir: str | None = None,
    kind: str = "both",
    features: str = "prelogits",
    k: int = 20,
    temperature: float = 0.07,
    batch_size: int = 256,
    device: str = "auto",
    cache_dir: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The linear and / or k-NN probe report of a checkpoint on a dataset."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if k < 1 or not 0 < temperature < float("inf"):  # before any feature is extracted
        raise ValueError(f"k-NN needs --k >= 1 and --temperature > 0, got {k} and {temperature}")
    extractor = Extractor(source, features, device, batch_size, cache_dir, progress)
    train, test, about = train_and_test(extractor, data, data_dir)
    report: dict[str, Any] = {**about}
    if kind in ("linear", "both"):
        report["linear"] = {
            **linear_probe(train.x.numpy(), train.y.numpy(), test.x.numpy(), test.y.numpy()),
            "protocol": "multinomial logistic regression (L-BFGS) on features standardised "
            "with the training features' mean and std; C chosen on a held-out part, refitted",
        }
    if kind in ("knn", "both"):
        report["knn"] = {
            **knn_probe(train, test, k, temperature),
            "protocol": "cosine similarity of L2-normalised features; the k nearest training "
            "features vote with weight exp(sim / T), summed per class",
        }
    return report


def format_probe(report: dict[str, Any]) -> str:
    """The report as text."""
    lines = [
        f"{report['checkpoint'] or report['source']} on {report['data']}: probes of frozen "
        f"{report['features']} features (D={report['feature_dim']})",
        f"{report['num_train_images']:,} train / {report['num_test_images']:,} test images, "
        f"{report['num_classes']} classes",
        "",
    ]
    if "linear" in report:
        r = report["linear"]
        grid = "  ".join(f"C={g['C']:g}: {100 * g['val_top1']:.2f}%" for g in r["grid"])
        lines += [
            f"linear  top-1 {100 * r['top1']:6.2f}%   C={r['C']:g}",
            f"        validation ({r['num_val_images']:,} held-out images): {grid}",
        ]
    if "knn" in report:
        r = report["knn"]
        lines.append(
            f"k-NN    top-1 {100 * r['top1']:6.2f}%   k={r['k']}, T={r['temperature']:g}, cosine"
        )
    return "\n".join(lines)
