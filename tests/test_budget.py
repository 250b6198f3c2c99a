"""train.time_budget: durations parse, the step plan is the arithmetic it states, the schedule
spans the planned steps, and a budgeted `vitlab train` ends within its budget."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest

from vitlab.config import ConfigError, load_run_config
from vitlab.duration import parse_duration
from vitlab.runtime import Dist
from vitlab.train import budget
from vitlab.train.budget import Costs, TimeBudget, budget_schedule, plan_steps
from vitlab.train.engine import StepSettings
from vitlab.train.state import load_train_state


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("3m", 180), ("1h", 3600), ("1h30m", 5400), ("2m30s", 150), ("1.5m", 90),
     (" 45 ", 45), (45, 45), (7.5, 7.5), ("1H2M3S", 3723), ("0.5h", 1800)],
)  # fmt: skip
def test_durations(text, seconds) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["3x", "", "m", "-5", "0s", 0, -1, "1m1h", "3 minutes", True,
                                 "1h1h", "inf", "nan", None])  # fmt: skip
def test_bad_durations_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="expected a duration above 0 such as 90s, 3m"):
        parse_duration(bad)


def test_the_config_checks_the_budget() -> None:
    assert load_run_config(None, ["train.time_budget=3m"]).train.time_budget == "3m"
    assert load_run_config(None, ["train.time_budget=90"]).train.time_budget == 90.0
    with pytest.raises(ConfigError, match="train.time_budget: expected a duration.*'3x'"):
        load_run_config(None, ["train.time_budget=3x"])


def test_plan_steps_by_hand() -> None:
    # 100 s, 20 s gone, 30 steps done (one epoch of 25 ended); 0.5 s a step, 2 s an epoch end,
    # 5 s for the test split. Usable: 100 * 0.95 - 1 - 20 - 5 = 69 s. N steps cost
    # (N - 30) * 0.5 + (ceil(N / 25) - 1) * 2: N = 148 costs 59 + 10 = 69; N = 149 costs 69.5
    costs = Costs(step=0.5, epoch_end=2.0, final=5.0)
    assert plan_steps(100, 20, 30, 25, costs) == 148
    # no epoch ends: (N - 30) * 0.5 <= 69 -> N = 168
    assert plan_steps(100, 20, 30, 25, Costs(0.5, 0.0, 5.0)) == 168
    # the budget is spent already: the step under way is the last
    assert plan_steps(100, 99, 30, 25, costs) == 31
    assert plan_steps(100, 20, 30, 25, Costs(100.0, 0.0, 5.0)) == 31


def test_the_schedule_spans_the_planned_steps() -> None:
    cfg = load_run_config(None, ["optim.lr=0.002", "optim.min_lr=0.0001"])
    lr = budget_schedule(cfg, total=148, warmup=50)  # warm-up capped at 148 // 5 = 29 steps
    assert lr(0) == pytest.approx(0.002 / 29) and lr(28) == pytest.approx(0.002)
    # the last step taken, 147: cosine at (147 - 29) / (148 - 29) of the way from 2e-3 to 1e-4
    last = 0.0001 + (0.002 - 0.0001) * 0.5 * (1 + math.cos(math.pi * 118 / 119))
    assert lr(147) == pytest.approx(last) and lr(147) < 0.0001 * 1.01
    assert lr(148) == pytest.approx(0.0001)


def test_the_budget_plans_from_timed_steps(tmp_path, monkeypatch) -> None:
    """Steps of 0.1 s on a fake clock, 5 s since the process started: planned after 3 + 20
    steps, planned again at the first epoch end (validation 1 s), then fixed."""
    cfg = load_run_config(None, ["train.time_budget=31s", "train.epochs=2", "optim.lr=0.001"])
    settings = StepSettings(1, None, lambda step: 0.5, nullcontext)
    clock = [0.0]
    monkeypatch.setattr(budget.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(budget, "process_age", lambda: 5.0 + clock[0])
    b = TimeBudget(cfg, settings, 40, 4, (64, 100, 200), tmp_path, Dist(), bf16=False)
    assert cfg.train.epochs == 2 and settings.max_steps is None
    step = 0
    while settings.max_steps is None or step < settings.max_steps:
        settings.lr_at(step)
        clock[0] += 0.1 + (1.0 if (step + 1) % 40 == 0 else 0.0)  # an epoch end after step 39
        step += 1
        assert step < 1000
    plan = json.loads((tmp_path / "time_budget.json").read_text())
    assert plan["final"] and plan["steps"] == step == b.total
    # by hand, at step 40: 5 + 5.0 s gone (40 steps and an epoch end); a step 0.1 s, an epoch end
    # 1.0 s, so 0.01 s an image, the test 200 * 0.01 + 2 s. Usable: 31 * 0.95 - 1 - 10 - 4 =
    # 14.45 s; (N - 40) * 0.1 + (ceil(N / 40) - 1) * 1.0 <= 14.45 -> N = 154 (11.4 + 3)
    assert step == 154 and cfg.train.epochs == 4
    assert settings.lr_at(153) < 0.001 * 0.001 and settings.lr_at(154) == 0.0


def test_a_plan_is_shortened_when_the_steps_slow_down(tmp_path, monkeypatch) -> None:
    """As above, but from step 60 every step and epoch end takes twice as long: the plan is
    shortened (never lengthened) so that the simulated command still ends within 31 s."""
    cfg = load_run_config(None, ["train.time_budget=31s", "optim.lr=0.001"])
    settings = StepSettings(1, None, lambda step: 0.5, nullcontext)
    clock = [0.0]
    monkeypatch.setattr(budget.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(budget, "process_age", lambda: 5.0 + clock[0])
    TimeBudget(cfg, settings, 40, 4, (64, 100, 200), tmp_path, Dist(), bf16=False)
    step, plans = 0, []
    while settings.max_steps is None or step < settings.max_steps:
        settings.lr_at(step)
        if settings.max_steps is not None and settings.max_steps not in plans:
            plans.append(settings.max_steps)
        slow = 2.0 if step >= 60 else 1.0
        clock[0] += slow * (0.1 + (1.0 if (step + 1) % 40 == 0 else 0.0))
        step += 1
    assert plans[-2] == 154 and plans[-1] < 154  # planned as above, then shortened
    # the last epoch's end (2 s now) and the test split (2 * 2 s + 2 s) after the last step
    assert 5.0 + clock[0] + 2.0 + 6.0 <= 31.0
    assert settings.lr_at(step - 1) < 0.001 * 0.001 and settings.lr_at(step) == 0.0


def test_a_budgeted_run_ends_in_time_and_says_what_it_bought(tmp_path: Path) -> None:
    out, seconds = tmp_path / "run", 20
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "vitlab", "train", "--out", str(out),
         f"train.time_budget={seconds}s", "train.threads=1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    wall = time.perf_counter() - t
    assert r.returncode == 0, r.stderr[-2000:]
    assert wall <= seconds + 3, wall
    plan = json.loads((out / "time_budget.json").read_text())
    steps = plan["steps"]
    assert f"time budget {seconds}s: {steps:,} steps (" in r.stderr
    assert load_train_state(out / "checkpoints" / "last")["step"] == steps
    epochs = len((out / "metrics.jsonl").read_text().splitlines())
    assert epochs == math.ceil(steps / 20)  # digits: 1,294 training images, 20 batches of 64
    assert json.loads((out / "results.json").read_text())["top1"] > 0.3
