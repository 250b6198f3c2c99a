"""`train.time_budget`: fit the whole `vitlab train` command (start-up, training, validation after
every epoch, the test split) into a duration, with the learning-rate schedule spanning the steps
actually taken (budget-aware schedules: Li et al. 2020, "Budgeted Training").

How: after SKIP_STEPS steps (allocation, compilation, caches) the next TIMED_STEPS steps are timed;
then the number of optimizer steps N is planned (plan_steps) from the time the command has been
running (`vitlab train`: since its process started; train() called in a longer-lived process: since
the call), the time per step, an estimate of each epoch's end (validation + checkpoints) and of the
test split, less a safety margin. At the first epoch end after that, whose cost is then measured,
N is planned once more. Then every CHECK_EVERY steps the pace of as many of the latest steps as
the plan has left (at least CHECK_EVERY, at most PACE_STEPS: the future is predicted from a past
about as long as it) is compared with the plan's, and when it differs by more than DRIFT (a shared
machine's neighbours come and go) N is planned again at that pace, longer or shorter, at any point
of the run. (Paced on the latest CHECK_EVERY steps alone, a 2-hour run alone on a shared 2-core
machine was planned 411 times; another, 16 times in its first 3 epochs, between 76 and 109 epochs:
one 10-second window's pace swung 0.7-1.3x from the next.) A stall between two steps of an epoch
(a paused process, a suspended laptop: one step longer than all others of its window together,
typical_step) is left out of the pace, its time only lost: N is planned again; so is it after an
epoch end that took a window's steps longer than the plan's estimate. (A stall at the first epoch
end is taken for every epoch end's cost: the plan stays short for the rest of the run.)
The schedule (warm-up as configured, at most a fifth of the steps, then the configured decay) is
laid over the first plan's N, its warm-up kept step for step (the steps before the first plan,
unplanned, take the configured schedule: a plan of under 5 x (SKIP_STEPS + TIMED_STEPS) steps
has warmed up past a fifth by then). A longer plan stretches what is left
of it over the steps left: the learning rate goes on from where it is (late in the run the decay
slows instead of being undone). A shorter plan first moves along it to where the step would be had
the run been planned that short from the start (a step down: the decay comes early, and a run cut
short still ends annealed), then goes on from there. So plans that swing short and long again
ratchet the schedule ahead, which pacing on a long window keeps rare (in the 411-plan run above
the learning rate was 16% under the cosine over the steps it took half-way through, 25% under it
at three quarters).
train.epochs is not used: the run trains ceil(N / steps per epoch) epochs, the last one possibly
partial. The decision points depend on step numbers only, so every rank plans at the same step;
rank 0's plan is broadcast.

The plan is written to RUN/time_budget.json with the schedule's pieces. `--resume` keeps it: a
resumed run, from any checkpoint, finishes the steps the first command's budget bought with the
learning rates the first command used or would have used, however long the break (the budget counts
the run as first planned, not the resumed command); a run stopped before it planned plans afresh,
counting this command's time.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from vitlab.config import RunConfig
from vitlab.duration import parse_duration
from vitlab.formats.base import CheckpointError, write_text
from vitlab.runtime import Dist, status_file
from vitlab.train import clock, distributed
from vitlab.train.build import Data
from vitlab.train.engine import StepSettings
from vitlab.train.optim import learning_rate

SKIP_STEPS = 3  # not timed: the first steps allocate, compile and warm caches
TIMED_STEPS = 20  # timed before the first plan
MARGIN = 0.05  # share of the budget left free for the machine's noise, plus MARGIN_S
MARGIN_S = 1.0
TAIL_S = 2.0  # after the test split: curves.png, results.json, exit
CHECK_EVERY = 50  # the plan is checked every this many steps against their pace
DRIFT = 0.05  # and made again when the latest steps are this much slower or faster
PACE_STEPS = 5000  # the most latest steps a pace is taken over (a 2-hour CPU run: ~17 minutes)
STUB = 0.05  # a last epoch shorter than this share of one is dropped
FORWARD = 1 / 3  # an evaluation image costs about this share of a training image (no backward)
PLAN_FILE = "time_budget.json"


@dataclass
class Costs:
    """Seconds that the rest of a run will cost."""

    step: float  # one optimizer step (forward, backward, update, data)
    epoch_end: float  # after each epoch: validation, checkpoints, log
    final: float  # after the last epoch: the test split and the last files


def plan_steps(
    budget: float, elapsed: float, steps_done: int, steps_per_epoch: int, costs: Costs
) -> int:
    """The most optimizer steps N (at least steps_done + 1: the step under way is taken) for which
    elapsed + (N - steps_done) step + (ceil(N / steps_per_epoch) - epochs ended) epoch_end
    + final <= budget (1 - MARGIN) - MARGIN_S, less a last epoch of at most STUB of one (not
    worth its validation). `steps_done` steps are taken, so steps_done // steps_per_epoch epochs
    have ended."""
    usable = budget * (1 - MARGIN) - MARGIN_S - elapsed - costs.final

    def cost(n: int) -> float:
        return steps_cost(n, steps_done, steps_per_epoch, costs)

    lo, hi = steps_done + 1, steps_done + 1 + max(0, int(usable / max(costs.step, 1e-9)))
    if cost(lo) > usable:
        return lo
    while lo < hi:  # cost grows with n: the last n that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= usable else (lo, mid - 1)
    stub = lo % steps_per_epoch  # a last epoch of a few steps is not worth its validation
    return lo - stub if 0 < stub <= STUB * steps_per_epoch and lo - stub > steps_done else lo


def steps_cost(n: int, steps_done: int, steps_per_epoch: int, costs: Costs) -> float:
    """Seconds from step `steps_done` to step `n`, the ends of the epochs between included."""
    ended = steps_done // steps_per_epoch
    return (n - steps_done) * costs.step + (math.ceil(n / steps_per_epoch) - ended) * (
        costs.epoch_end
    )


def budget_schedule(cfg: RunConfig, total: int, warmup: int) -> Callable[[int], float]:
    """The run's learning rate at each step when it takes `total` steps: warm-up (at most a
    fifth of them), then the configured decay ending at step `total`."""
    warm = min(warmup, total // 5)
    return lambda step: learning_rate(cfg.optim, step, total, warm)


class TimeBudget:
    """Watches the steps through StepSettings.lr_at, plans N and stops training there
    (StepSettings.max_steps); sets cfg.train.epochs to the epochs N covers."""

    def __init__(
        self,
        cfg: RunConfig,
        settings: StepSettings,
        steps_per_epoch: int,
        warmup: int,
        images: tuple[int, int, int],
        out: Path,
        d: Dist,
        bf16: bool = False,
        resumed: bool = False,
        before: float = 0.0,
    ) -> None:
        self.cfg, self.settings, self.d = cfg, settings, d
        self.before = before  # seconds of the process's life before the command began
        self.spe, self.warmup = steps_per_epoch, warmup
        self.batch, self.val_images, self.test_images = images
        self.test_factor = 2.0 if bf16 else 1.0  # the test split runs in fp32
        self.text = str(cfg.train.time_budget)
        self.seconds = parse_duration(cfg.train.time_budget, "train.time_budget")
        self.file = Path(out) / PLAN_FILE
        self.first: int | None = None  # the first step this process takes
        self.last: tuple[int, float] | None = None  # (step, time) at the previous lr_at
        self.steps: list[float] = []  # seconds of timed steps
        self.recent: deque[float] = deque(maxlen=CHECK_EVERY)  # the latest of them
        self.history: deque[float] = deque(maxlen=PACE_STEPS)  # steps' seconds: the pace
        self.ends: list[float] = []  # seconds of measured epoch ends
        self.stalled = 0.0  # seconds epoch ends took past the plan's estimate, not yet planned for
        self.total: int | None = None
        self.planned: Costs | None = None  # what the plan in force assumed
        self.final = False
        self.span = 0  # the steps the schedule is laid over: the first plan's
        # (from step, the schedule's step there, the plan's steps then): where each plan began
        self.pieces: list[tuple[int, float, int]] = []
        self.watch = not (resumed and self.file.is_file())
        if not self.watch:  # a resumed run keeps its plan
            try:  # a plan written before "schedule": laid over its steps
                plan = json.loads(self.file.read_text(encoding="utf-8"))
                total = int(plan["steps"])
                laid = plan.get("schedule", {"span": total, "pieces": [[0, 0.0, total]]})
                self.span = int(laid["span"])
                self.pieces = [(int(a), float(w), int(n)) for a, w, n in laid["pieces"]]
            except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
                raise CheckpointError(
                    f"{self.file}, the run's time-budget plan, is damaged "
                    f"({type(e).__name__}: {e}): the run cannot go on as planned"
                ) from None
            self._fix(total, final=True)
            if d.is_main:
                print(
                    f"time budget {self.text}: resumed, keeping the run's plan of "
                    f"{self.total:,} steps ({self.total / self.spe:.1f} epochs)",
                    file=status_file(),
                )
        else:  # reach the planning step, whatever train.epochs says
            reach = math.ceil((SKIP_STEPS + TIMED_STEPS + 2) / self.spe)
            cfg.train.epochs = max(cfg.train.epochs, reach)
        self.provisional = settings.lr_at
        settings.lr_at = self.lr_at

    def lr_at(self, step: int) -> float:
        """The learning rate of step `step` (`step` steps taken); times the steps and plans,
        once a step (the engine asks once per parameter group)."""
        if self.watch and (self.last is None or self.last[0] != step):
            self._observe(step, clock.step_clock())
        if self.total is None:
            return self.provisional(step)
        return self.schedule(step)

    def _observe(self, step: int, now: float) -> None:
        if self.first is None:
            self.first = step
        last = self.last
        if last is not None and last[0] == step - 1 and last[0] >= self.first + SKIP_STEPS:
            gap = now - last[1]
            if step % self.spe == 0 and self.steps:  # an epoch ended between the two steps
                typical = typical_step(self.recent or self.steps)[0]
                self.ends.append(max(0.0, gap - typical))
                was = self.planned
                if self.final and was and self.ends[-1] > was.epoch_end + typical * CHECK_EVERY:
                    self.stalled += self.ends[-1] - was.epoch_end  # lost at the epoch end
            else:
                if not self.final:  # what the plans before the first epoch end use
                    self.steps.append(gap)
                self.recent.append(gap)
                self.history.append(gap)
        self.last = (step, now)
        if self.total is None and step == self.first + SKIP_STEPS + TIMED_STEPS:
            self._plan(step, self._costs, final=bool(self.ends))  # final: an epoch end measured
        elif self.total is not None and not self.final and self.ends:  # the first epoch end
            self._plan(step, self._costs, final=True, note=" (planned again after an epoch end)")
            self.recent.clear()  # stalls are looked for in the steps after this plan
        elif self.total is not None and step % CHECK_EVERY == 0:
            stalls = typical_step(self.recent, CHECK_EVERY)[1] if self.recent else 0.0
            lost = stalls + self.stalled
            why = f"after a stall of {lost:.0f} s" if lost else "the steps' pace changed"
            paced = lambda: self._paced(step, stalls)  # noqa: E731
            # final only once an epoch end is measured: the first one's plan is still to come
            self._plan(step, paced, final=bool(self.ends), note=f" (planned again: {why})")
            self.stalled = 0.0  # planned for (on rank 0; every rank forgets it alike)
            if lost:  # the stall is planned for (or the plan kept): not counted again
                self.recent.clear()

    def _costs(self) -> Costs:
        step, _ = typical_step(self.steps, CHECK_EVERY)  # a stall: a window's steps, not an epoch's
        per_image = step / self.batch * FORWARD
        if self.ends:
            end = sum(self.ends) / len(self.ends)
            per_image = end / self.val_images if self.val_images else per_image
        else:
            end = self.val_images * per_image + 0.2
        return Costs(step, end, self.test_images * per_image * self.test_factor + TAIL_S)

    def _paced(self, step: int, lost: float) -> Costs | None:
        """The plan's costs scaled to the pace of the latest steps, as many as the plan has left
        (at least CHECK_EVERY), when that differs by more than DRIFT, or when a stall lost time:
        `lost` among the latest steps, or self.stalled at epoch ends (None: on plan)."""
        was, stalled = self.planned, self.stalled
        if was is None:
            return None
        if len(self.recent) < CHECK_EVERY // 2:  # too few steps to pace: a stall at an epoch end
            return was if stalled else None  # costs its time at the plan's pace
        left = max(CHECK_EVERY, (self.total or 0) - step)
        tail = islice(self.history, max(0, len(self.history) - left), None)  # in order, no copy
        now = typical_step(list(tail), CHECK_EVERY)[0]
        if abs(now / was.step - 1) <= DRIFT and not lost and not stalled:
            return None
        k = now / was.step
        return Costs(now, was.epoch_end * k, (was.final - TAIL_S) * k + TAIL_S)

    def _plan(
        self,
        step: int,
        costing: Callable[[], Costs | None],
        final: bool,
        note: str = "",
    ) -> None:
        """Plan on rank 0 with `costing`'s costs (None: keep the plan), the same on every
        rank."""
        plan = None
        costs = costing() if self.d.is_main else None
        if costs is not None:
            elapsed = clock.process_age() - self.before
            n = plan_steps(self.seconds, elapsed, step, self.spe, costs)
            plan = None if n == self.total else (n, costs)
            past = elapsed + steps_cost(n, step, self.spe, costs) + costs.final - self.seconds
            if past > 0 and plan is not None:  # start-up and evaluation alone outlast it
                note += (
                    f"; the budget is too short for this run: it ends about {past:.0f} s past it"
                )
        plan = distributed.broadcast(plan, self.d)
        if plan is None:  # the plan stands (and, once final, the epoch-end re-plan is done)
            self.final = self.final or final
            return
        (total, costs), self.planned = plan, plan[1]
        if self.total is None:  # the first plan: the schedule is laid over its steps
            self.span, self.pieces = total, [(0, 0.0, total)]
        else:
            self._replan(step, total)
        self._fix(total, final)
        if self.d.is_main:
            self._tell(total, costs, final, note)

    def _tell(self, total: int, costs: Costs, final: bool, note: str) -> None:
        """Log the plan and write it to RUN/time_budget.json."""
        epochs, speed = total / self.spe, self.batch / costs.step
        plan = {
            "budget": self.text,
            "seconds": self.seconds,
            "steps": total,
            "epochs": round(epochs, 2),
            "images_per_s": round(speed, 1),
            "final": final,
            "estimates_s": {k: round(v, 3) for k, v in vars(costs).items()},  # Costs' fields
            "schedule": {"span": self.span, "pieces": [list(p) for p in self.pieces]},
        }
        write_text(self.file, json.dumps(plan) + "\n")  # atomic: --resume reads it
        from tqdm import tqdm  # its write: a line of its own, not inside the progress bar's

        tqdm.write(
            f"time budget {self.text}: {total:,} steps ({epochs:.1f} epochs) at "
            f"{speed:,.0f} img/s{note}",
            file=status_file(),
        )

    def _replan(self, step: int, total: int) -> None:
        """A new plan of `total` steps at step `step`: what is left of the schedule goes over the
        steps left. The warm-up stays as first laid, step for step: a plan made during it begins
        where it ends."""
        warm = min(self.warmup, self.span // 5)
        if step < warm < total:
            start, here = warm, float(warm)
        else:
            start, here = step, self.schedule_step(step)  # on the plan in force
            if total < self.total:  # where this step would be, planned this short from the start
                here = max(here, step * self.span / total)
        self.pieces = [p for p in self.pieces if p[0] < start] + [(start, here, total)]

    def schedule_step(self, step: int) -> float:
        """Where step `step` is on the schedule laid over self.span steps: from where the plan
        in force at that step began, its steps left cover the schedule's steps left evenly (its
        last step would end the schedule)."""
        start, where, total = next(p for p in reversed(self.pieces) if p[0] <= step)
        return where + (step - start) * (self.span - where) / max(1, total - start)

    def _fix(self, total: int, final: bool) -> None:
        self.total, self.final = total, final
        laid = budget_schedule(self.cfg, self.span, self.warmup)
        self.schedule = lambda step: laid(self.schedule_step(step))
        self.settings.max_steps = total
        self.cfg.train.epochs = math.ceil(total / self.spe)


def typical_step(seconds: Sequence[float], count: int | None = None) -> tuple[float, float]:
    """(mean seconds of the steps leaving out stalls, the seconds the stalls lost over that mean).
    A stall: a step longer than the median times the steps' count (or `count`), about all the
    others of a window together (a paused process, not the machine's jitter: a slow step now and
    then stays in the mean)."""
    limit = statistics.median(seconds) * (count or len(seconds))
    kept = [s for s in seconds if s <= limit]
    mean = sum(kept) / len(kept)
    return mean, sum(s - mean for s in seconds if s > limit)


def epochs_shown(b: TimeBudget | None, cfg: RunConfig, steps_per_epoch: int = 0) -> str:
    """The epoch count a progress bar shows: "?" while a time budget has not planned yet
    (train.epochs is not what the run will train), then the plan's; those train.max_steps
    covers where it ends the run sooner (`steps_per_epoch` optimizer steps an epoch)."""
    if b is not None and b.total is None:
        return "?"
    steps = cfg.train.max_steps if b is None and steps_per_epoch else None
    return str(
        min(cfg.train.epochs, math.ceil(steps / steps_per_epoch)) if steps else cfg.train.epochs
    )


def attach(
    cfg: RunConfig,
    settings: StepSettings,
    batches_per_epoch: int,
    data: Data,
    out: Path,
    d: Dist,
    bf16: bool,
    resumed: bool,
    before: float = 0.0,
) -> TimeBudget | None:
    """A TimeBudget driving `settings` when cfg.train.time_budget is set. `bf16`: the training
    precision (the test split runs in fp32); `resumed`: keep the run's plan; `before`: seconds of
    the process's life before the command began (not in the budget)."""
    if cfg.train.time_budget is None:
        return None
    spe = batches_per_epoch // cfg.train.accum_steps
    warmup = int(round(cfg.optim.warmup_epochs * spe))  # as Run.warmup_steps
    val = len(data.val) if data.val is not None else 0
    images = (cfg.train.batch_size * cfg.train.accum_steps, val, len(data.test))  # one step's
    return TimeBudget(cfg, settings, spe, warmup, images, out, d, bf16, resumed, before)
