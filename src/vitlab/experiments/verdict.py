"""Verdicts computed from measurements: every rule is a pure function of per-seed numbers that
returns the outcome and the rule it applied, stated in words for the report.

One vocabulary for every claim of a difference d between two quantities (a mean over seeds each):
the margin m is twice the largest seed spread (sample standard deviation, ddof 1) among the arms
the rule compares, and never less than a floor stated by the rule (the smallest difference worth
a verdict at these budgets). d > m: the difference is there; d < -m: the opposite is there;
otherwise it is within noise. With one seed there is no spread, and the margin is the floor alone
(the report says so): a single seed can still decide, but only on a difference above the floor.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
ACC_FLOOR = 0.01  # one percentage point of accuracy
DISTANCE_FLOOR = 1.0  # pixels of mean attention distance
SIMILARITY_FLOOR = 0.05  # cosine similarity
# patch-size: the fewest optimizer steps an arm must take for its accuracy to speak for its model
# (fewer: warm-up and cosine decay squeezed into a handful of steps leave it barely trained)
MIN_STEPS = 100


@dataclass(frozen=True)
class Stat:
    """One quantity over seeds: mean and spread (sample std, None with one seed)."""

    values: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def spread(self) -> float | None:
        return statistics.stdev(self.values) if self.n > 1 else None

    def text(self, scale: float = 100.0, digits: int = 2) -> str:
        """'87.31 ± 0.42' (× scale: percent by default); one seed: '87.31'."""
        mean = f"{self.mean * scale:.{digits}f}"
        return mean if self.spread is None else f"{mean} ± {self.spread * scale:.{digits}f}"


def stat(values: Iterable[float]) -> Stat:
    values = tuple(float(v) for v in values)
    if not values or not all(math.isfinite(v) for v in values):
        raise ValueError(f"a statistic needs finite values, got {values}")
    return Stat(values)


@dataclass
class Verdict:
    outcome: str  # HOLDS | FAILS | INCONCLUSIVE
    rule: str  # the rule, in words, with its margin
    reason: str  # the numbers that decided it
    parts: list[Verdict] = field(default_factory=list)  # a combined verdict's sub-claims

    def to_dict(self) -> dict:
        return {
            "outcome": self.outcome,
            "rule": self.rule,
            "reason": self.reason,
            "parts": [p.to_dict() for p in self.parts],
        }


def accuracy_floor(test_images: int, accuracies: Iterable[Stat], compared: int = 2) -> float:
    """The floor for a difference of `compared` accuracies (2: one arm's against another's; 4: the
    change of a lead between two sizes) measured on `test_images` images: twice its binomial
    standard error at the compared arms' mean accuracy p, as if the accuracies' errors were
    independent, 2 sqrt(compared p (1 - p) / n), and at least ACC_FLOOR. The arms of one seed are
    tested on the same images (all of the test split, or the seed's share of it), so the seed
    spread need not show this noise."""
    p = statistics.fmean(s.mean for s in accuracies)
    n = max(test_images, 1)
    return max(ACC_FLOOR, 2 * math.sqrt(compared * max(p * (1 - p), 0.0) / n))


FLOOR_TEXT = (
    "The accuracy floor is twice the binomial standard error of the compared difference on the n "
    "test images used, 2 sqrt(k p (1 - p) / n) for a difference of k accuracies (k = 2, one arm "
    "against another; 4 for the change of a lead between two sizes) at the compared arms' mean "
    "accuracy p, as if their errors were independent, and at least 1 pp: the arms of a seed "
    "share their test images, and with the whole test split so do all seeds, so the seed spread "
    "need not hold that noise."
)


def margin(stats: Sequence[Stat], floor: float) -> tuple[float, str]:
    """(m, how it was set): 2 x the largest seed spread among `stats`, at least `floor`; the floor
    alone when any of them has one seed."""
    spreads = [s.spread for s in stats]
    if any(s is None for s in spreads):
        return floor, "the floor (one seed: no spread to measure)"
    top = max(spreads)
    if 2 * top >= floor:
        return 2 * top, "2 x the largest seed spread"
    return floor, "the floor (2 x the largest seed spread is below it)"


def compare(d: float, m: float) -> int:
    """+1: d > m; -1: d < -m; 0: within noise."""
    return 1 if d > m else -1 if d < -m else 0


def _pp(x: float) -> str:
    return f"{100 * x:+.2f} pp"


def _m(m: float, how: str, unit: str = "pp") -> str:
    value = f"{100 * m:.2f} pp" if unit == "pp" else f"{m:.3g} {unit}"
    return f"m = {value}, {how}"


def pos_embed_verdict(none: Stat, positional: dict[str, Stat], floor: float = ACC_FLOOR) -> Verdict:
    """Table 8: the model without positions is clearly worst; the kinds with positions tie."""
    m, how = margin([none, *positional.values()], floor)
    means = {k: s.mean for k, s in positional.items()}
    lo, hi = min(means, key=means.get), max(means, key=means.get)
    gap, tie = means[lo] - none.mean, means[hi] - means[lo]
    rule = (
        f"With m = max(2 x the largest seed spread, {100 * floor:.2f} pp) (the floor alone with "
        f"one seed): holds if the worst arm with positions ({', '.join(positional)}) is above "
        f"the no-position arm by more than m and the arms with positions lie within m of each "
        f"other; does not hold if the no-position arm is above the worst arm with positions by "
        f"more than m, or the arms with positions differ by more than 2m; else inconclusive."
    )
    reason = (
        f"worst with positions ({lo}) - none = {_pp(gap)}; best ({hi}) - worst ({lo}) = "
        f"{_pp(tie)}; {_m(m, how)}"
    )
    if gap < -m or tie > 2 * m:
        return Verdict(FAILS, rule, reason)
    if gap > m and tie <= m:
        return Verdict(HOLDS, rule, reason)
    return Verdict(INCONCLUSIVE, rule, reason)


def data_scale_verdict(
    cnn: dict[int, Stat], vit: dict[int, Stat], floor: float = ACC_FLOOR, metric: str = "test top-1"
) -> Verdict:
    """§4.3: the CNN is ahead on the smallest set; its lead shrinks (or flips) on the largest.
    `metric`: what the accuracies are, for the rule's words."""
    sizes = sorted(set(cnn) & set(vit))
    if len(sizes) < 2:
        raise ValueError(f"the data-scale verdict needs two sizes or more, got {sizes}")
    small, large = sizes[0], sizes[-1]
    m, how = margin([cnn[small], vit[small], cnn[large], vit[large]], floor)
    lead_small = cnn[small].mean - vit[small].mean
    lead_large = cnn[large].mean - vit[large].mean
    gain = vit[large].mean - vit[small].mean
    rule = (
        f"{metric}: lead = CNN - ViT {metric} at a size; m = max(2 x the largest seed spread of "
        f"the four arms compared, {100 * floor:.2f} pp) (the floor alone with one seed). Holds if "
        f"the lead at the smallest size is above m and shrinks by more than m at the largest "
        f"size (narrowing or flipping) while the ViT gains more than m; does not hold if the "
        f"ViT leads by more than m at the smallest size, or the lead grows by more than m while "
        f"the ViT gains more than m from the smallest size to the largest; else inconclusive (a "
        f"ViT that gains no more than m from the data is bound by its steps, not by the data: "
        f"the claim is not tested)."
    )
    reason = (
        f"{metric}: lead at {small:,} images {_pp(lead_small)}, at {large:,} images "
        f"{_pp(lead_large)}; the ViT gains {_pp(gain)}; {_m(m, how)}"
    )
    if lead_small < -m or (lead_large - lead_small > m and gain > m):
        return Verdict(FAILS, rule, reason)
    if lead_small > m and lead_small - lead_large > m and gain > m:
        return Verdict(HOLDS, rule, reason)
    return Verdict(INCONCLUSIVE, rule, reason)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys against xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def patch_size_verdict(
    vits: dict[int, dict[str, Stat]],
    cnn: dict[str, Stat],
    floor: float = ACC_FLOOR,
    steps: dict[int | str, dict[str, int]] | None = None,
    cnn_ratio: float | None = None,
    vit_floor: float | None = None,
) -> Verdict:
    """Fig. 5 and Table 6 at matched compute. `vits`: patch side -> compute level -> test top-1
    of the plain ViT; `cnn`: compute level -> the ResNet's; levels cheapest first, the same in
    both, each Stat's values in seed order; `steps`: patch side (or "cnn") -> level -> the
    optimizer steps that arm took (None: every arm counts as trained); `cnn_ratio`: the ResNet's
    training FLOPs an image over the patch-4 ViT's, for the rule's words. Two parts: at every
    level where the ResNet and a ViT trained at least MIN_STEPS steps the best such ViT beats the
    ResNet; smaller patches gain on larger ones as the compute grows. `floor`: the accuracy floor
    at the mean accuracy of the ResNet's and every ViT's arms (the first part's candidates),
    `vit_floor` at the ViTs' (the second part's arms; None: `floor`)."""
    levels = list(cnn)
    if len(levels) < 2 or any(list(v) != levels for v in vits.values()) or len(vits) < 2:
        raise ValueError(f"the patch-size verdict needs two or more patch sizes at the same two or "
                         f"more compute levels, got {levels} and {vits}")  # fmt: skip
    return combine(
        [_vit_beats_cnn(vits, cnn, floor, steps, cnn_ratio),
         _smaller_patches_gain(vits, floor if vit_floor is None else vit_floor)]
    )  # fmt: skip


def _vit_beats_cnn(
    vits: dict[int, dict[str, Stat]],
    cnn: dict[str, Stat],
    floor: float,
    steps: dict[int | str, dict[str, int]] | None,
    cnn_ratio: float | None,
) -> Verdict:
    ratio = "" if cnn_ratio is None else f" ({cnn_ratio:.3g}x the patch-4 ViT's FLOPs an image)"
    rule = (
        f"At each compute level, take the plain ViT (patch sizes {', '.join(map(str, vits))}) of "
        f"the highest mean test top-1 among those that took at least {MIN_STEPS} optimizer steps "
        f"there; d = its top-1 - the ResNet's at that level; m = max(2 x the larger seed spread "
        f"of the two, {100 * floor:.2f} pp) (the floor alone with one seed). A level is judged "
        f"only if the ResNet{ratio} took at least {MIN_STEPS} steps too: this part compares "
        f"architectures, and a model trained for a handful of steps says nothing about its "
        f"architecture. Holds if d > m at every judged level; does not hold if d < -m at any "
        f"judged level; else (or with no level judged) inconclusive."
    )
    signs, reasons = [], []
    for level, c in cnn.items():
        trained = [p for p in vits if steps is None or steps[p][level] >= MIN_STEPS]
        if not trained:
            reasons.append(f"{level}: not judged (no ViT took {MIN_STEPS} steps)")
            continue
        best = max(trained, key=lambda p: vits[p][level].mean)
        acc = vits[best][level]
        m, how = margin([acc, c], floor)
        d = acc.mean - c.mean
        text = f"{level}: patch {best} - ResNet = {_pp(d)} ({_m(m, how)})"
        if steps is not None:
            text += f", steps: patch {best} {steps[best][level]:,}, ResNet {steps['cnn'][level]:,}"
            if steps["cnn"][level] < MIN_STEPS:
                reasons.append(f"{text}: not judged (the ResNet took fewer than {MIN_STEPS})")
                continue
        signs.append(compare(d, m))
        reasons.append(text)
    outcome = FAILS if -1 in signs else HOLDS if signs and set(signs) == {1} else INCONCLUSIVE
    return Verdict(outcome, rule, "; ".join(reasons))


def _smaller_patches_gain(vits: dict[int, dict[str, Stat]], floor: float) -> Verdict:
    patches = sorted(vits)
    low, high = list(vits[patches[0]])[0], list(vits[patches[0]])[-1]
    seeds = {s.n for p in patches for s in vits[p].values()}
    if len(seeds) != 1:
        raise ValueError(f"every arm of the patch-size verdict needs the same seeds, got {seeds}")
    xs = [math.log2(p) for p in patches]

    def s_at(level: str, seed: int) -> float:  # pp per doubling of the patch side
        return 100 * slope(xs, [vits[p][level].values[seed] for p in patches])

    d = stat(s_at(low, i) - s_at(high, i) for i in range(seeds.pop()))
    m, how = margin([d], 100 * floor)
    rule = (
        f"s = the least-squares slope of test top-1 against log2(patch side) over the plain ViTs "
        f"at a compute level, in pp per doubling of the side (negative: smaller patches more "
        f"accurate), per seed; d = s at the smallest level ({low}) - s at the largest ({high}); "
        f"m = max(2 x the seed spread of d, {100 * floor:.2f} pp) (the floor alone with one "
        f"seed; the accuracy floor, above the slope's own binomial noise). Holds if d > m "
        f"(smaller patches gain on larger ones as the compute grows); does not hold if d < -m; "
        f"else inconclusive. Every arm counts here, however few its steps (unlike the "
        f"ViT-against-ResNet part): the steps a patch size affords at a level are the trade-off "
        f"this part measures, so a small patch's few steps at the smallest level are its cost, "
        f"not noise."
    )
    per = "; ".join(f"s at {lv} = {statistics.fmean(s_at(lv, i) for i in range(d.n)):+.2f} pp"
                    for lv in (low, high))  # fmt: skip
    reason = f"{per}; d = {d.mean:+.2f} pp; {_m(m / 100, how)}"
    return Verdict({1: HOLDS, -1: FAILS, 0: INCONCLUSIVE}[compare(d.mean, m)], rule, reason)


def mpp_verdict(scratch: Stat, mpp: Stat, supervised: Stat, floor: float = ACC_FLOOR) -> Verdict:
    """§4.6: masked-patch pre-training beats training from scratch and falls short of supervised
    pre-training on more labelled data."""
    m, how = margin([scratch, mpp, supervised], floor)
    up, down = mpp.mean - scratch.mean, supervised.mean - mpp.mean
    rule = (
        f"m = max(2 x the largest seed spread of the three arms, {100 * floor:.2f} pp) (the "
        f"floor alone with one seed). Holds if MPP - scratch > m and supervised - MPP > m; does "
        f"not hold if MPP - scratch < -m or supervised - MPP < -m; else inconclusive."
    )
    reason = f"MPP - scratch = {_pp(up)}; supervised - MPP = {_pp(down)}; {_m(m, how)}"
    a, b = compare(up, m), compare(down, m)
    if a < 0 or b < 0:
        return Verdict(FAILS, rule, reason)
    if a > 0 and b > 0:
        return Verdict(HOLDS, rule, reason)
    return Verdict(INCONCLUSIVE, rule, reason)


def greater_verdict(name: str, d: Stat, floor: float, unit: str, claim: str) -> Verdict:
    """One sub-claim 'd > 0' (d measured per seed): holds if mean d > m, does not hold if
    mean d < -m, m = max(2 x d's seed spread, floor)."""
    m, how = margin([d], floor)
    rule = (
        f"{claim}: d = {name}; m = max(2 x the seed spread of d, {floor:g} {unit}) (the floor "
        f"alone with one seed); holds if d > m, does not hold if d < -m, else inconclusive."
    )
    reason = f"d = {d.mean:+.3g} {unit}; {_m(m, how, unit)}"
    return Verdict({1: HOLDS, -1: FAILS, 0: INCONCLUSIVE}[compare(d.mean, m)], rule, reason)


def combine(parts: list[Verdict]) -> Verdict:
    """All sub-claims hold: holds; any does not hold: does not hold; else inconclusive."""
    outcomes = [p.outcome for p in parts]
    outcome = FAILS if FAILS in outcomes else HOLDS if set(outcomes) == {HOLDS} else INCONCLUSIVE
    rule = (
        "The claim holds if every part below holds, does not hold if any part does not hold, and "
        "is inconclusive otherwise."
    )
    reason = "; ".join(f"part {i + 1}: {o}" for i, o in enumerate(outcomes))
    return Verdict(outcome, rule, reason, parts)
