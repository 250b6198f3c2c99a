"""train.time_budget: durations parse, the step plan is the arithmetic it states, the schedule
spans the planned steps, and a budgeted `vitlab train` ends within its budget."""

from __future__ import annotations

import json
import math
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest

from tests.helpers import TINY_MODEL, VITLAB
from vitlab.cli.main import main
from vitlab.config import ConfigError, load_run_config
from vitlab.duration import parse_duration
from vitlab.formats.base import CheckpointError
from vitlab.runtime import Dist
from vitlab.train import budget, clock
from vitlab.train.budget import Costs, TimeBudget, budget_schedule, plan_steps
from vitlab.train.engine import StepSettings
from vitlab.train.run import train
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


def test_train_epochs_given_with_a_budget_is_said_to_be_unused(tmp_path, capsys) -> None:
    """`vitlab train --config configs/digits.yaml train.epochs=2` (as --help's example once did
    with the quick preset) trained the budget's 130 epochs without a word; now a warning says
    train.epochs is not used (here before the missing data ends the command)."""
    missing = f"data.name=imagefolder:{tmp_path / 'missing'}"
    preset = str(Path(__file__).resolve().parents[1] / "configs" / "digits.yaml")
    args = ["train", "--out", str(tmp_path / "r"), "--config", preset, missing]
    assert main([*args, "train.epochs=2"]) == 2
    err = capsys.readouterr().err
    assert "train.epochs=2 is not used: train.time_budget=60s plans the steps" in err, err
    assert main([*args, "train.epochs=2", "train.time_budget=null"]) == 2
    assert main(args) == 2
    assert "is not used" not in capsys.readouterr().err


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
    now = [0.0]
    monkeypatch.setattr(clock, "step_clock", lambda: now[0])
    monkeypatch.setattr(clock, "process_age", lambda: 5.0 + now[0])
    b = TimeBudget(cfg, settings, 40, 4, (64, 100, 200), tmp_path, Dist(), bf16=False)
    assert cfg.train.epochs == 2 and settings.max_steps is None
    step = 0
    while settings.max_steps is None or step < settings.max_steps:
        settings.lr_at(step)
        now[0] += 0.1 + (1.0 if (step + 1) % 40 == 0 else 0.0)  # an epoch end after step 39
        step += 1
        assert step < 1000
    plan = json.loads((tmp_path / "time_budget.json").read_text())
    assert plan["final"] and plan["steps"] == step == b.total
    # by hand, at step 40: 5 + 5.0 s gone (40 steps and an epoch end); a step 0.1 s, an epoch end
    # 1.0 s, so 0.01 s an image, the test 200 * 0.01 + 2 s. Usable: 31 * 0.95 - 1 - 10 - 4 =
    # 14.45 s; (N - 40) * 0.1 + (ceil(N / 40) - 1) * 1.0 <= 14.45 -> N = 154 (11.4 + 3)
    assert step == 154 and cfg.train.epochs == 4
    assert settings.lr_at(153) < 0.001 * 0.001 and settings.lr_at(154) == 0.0


def run_on_a_fake_clock(
    monkeypatch, tmp_path, seconds: int, pace, spe: int = 40, warmup: int = 4, lrs=None, end=1.0
) -> tuple[list[int], float]:
    """A TimeBudget of `seconds` driven step by step, `spe` steps an epoch, the process 5 s old at
    step 0, step s taking pace(s) * 0.1 s and an epoch end pace(s) * `end` s. Returns the plans
    made and the simulated command's length (with the last epoch's end and the test split).
    Checks on the way that the learning rate never rises past the warm-up and rises linearly in
    it however often the plan changes, and that a run resumed from the plan's file has the same
    schedule from the first plan on. `lrs`: a list to append every step's learning rate to."""
    cfg = load_run_config(None, [f"train.time_budget={seconds}s", "optim.lr=0.001"])
    settings = StepSettings(1, None, lambda step: 0.5, nullcontext)
    now = [0.0]
    monkeypatch.setattr(clock, "step_clock", lambda: now[0])
    monkeypatch.setattr(clock, "process_age", lambda: 5.0 + now[0])
    TimeBudget(cfg, settings, spe, warmup, (64, 100, 200), tmp_path, Dist(), bf16=False)
    step, plans, lrs = 0, [], [] if lrs is None else lrs
    while settings.max_steps is None or step < settings.max_steps:
        lrs.append(settings.lr_at(step))
        if settings.max_steps is not None and settings.max_steps not in plans:
            plans.append(settings.max_steps)
        now[0] += pace(step) * (0.1 + (end if (step + 1) % spe == 0 else 0.0))
        step += 1
    assert settings.lr_at(step - 1) < 0.001 * 0.001 and settings.lr_at(step) == 0.0
    first = budget.SKIP_STEPS + budget.TIMED_STEPS  # the first plan's step
    warm = min(warmup, plans[0] // 5)  # as first laid
    for s in range(first, warm):  # linear, whatever the plans made meanwhile
        assert lrs[s] == pytest.approx(0.001 * (s + 1) / warm), s
    decay = lrs[max(first, warm - 1) :]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(decay, decay[1:])), "the lr rose"
    resumed = StepSettings(1, None, lambda step: 0.5, nullcontext)
    TimeBudget(cfg, resumed, spe, warmup, (64, 100, 200), tmp_path, Dist(), resumed=True)
    laid = json.loads((tmp_path / "time_budget.json").read_text())["schedule"]
    assert resumed.max_steps == step and laid["span"] == plans[0]
    for s in range(first, step + 1):  # resumed from any step: the lr the run took there
        assert resumed.lr_at(s) == pytest.approx(lrs[s] if s < step else 0.0, abs=1e-15)
    # after the last step: the last epoch's end, and the test split (200 images at the epoch
    # end's 100 images a pace(s) * end s) and 2 s of files
    return plans, 5.0 + now[0] + pace(step) * end * (1.0 + 2.0) + 2.0


def test_a_plan_follows_the_steps_pace(tmp_path, monkeypatch) -> None:
    """Twice as slow from step 60 (past half of the plan): shortened, and still in time. Twice
    as fast from step 40 (before half of it), or slower for a while past half of it and then
    faster again: lengthened, and the budget used. Twice as slow from step 30 in an epoch longer
    than the run: shortened before any epoch end."""
    slower, faster = (lambda s: 2.0 if s >= 60 else 1.0), (lambda s: 0.5 if s >= 40 else 1.0)
    plans, length = run_on_a_fake_clock(monkeypatch, tmp_path, 31, slower)
    assert plans[1] == 154 and len(plans) == 3 and plans[2] < 154  # as above, then shortened
    assert length <= 31.0
    plans, length = run_on_a_fake_clock(monkeypatch, tmp_path, 61, faster)
    # 61 s at 0.1 s a step as above (379 steps), then lengthened
    assert plans[1] == 379 and plans[-1] > 379
    assert 61.0 * 0.9 <= length <= 61.0
    dip = lambda s: 2.0 if 450 <= s < 500 else 1.0  # noqa: E731  # past half of the plan
    plans, length = run_on_a_fake_clock(monkeypatch, tmp_path, 121, dip)
    assert min(plans[1:]) < plans[1] and plans[-1] > min(plans[1:])  # back up again
    assert 121.0 * 0.9 <= length <= 121.0
    plans, length = run_on_a_fake_clock(monkeypatch, tmp_path, 61, slower, spe=1000)
    assert len(plans) >= 2 and plans[-1] < plans[0]
    # a long warm-up (capped at a fifth of the first plan: 93 steps), the first epoch end's plan
    # (step 40, shorter) made during it
    plans, _ = run_on_a_fake_clock(monkeypatch, tmp_path, 61, slower, warmup=150)
    assert plans[0] // 5 == 93 and plans[1] < plans[0]
    # no epoch end measured, so validation and test are estimated (at a third of a training
    # image each: 2.35 s here, against the simulation's 6 s); the steps end in time for them
    assert length - 6.0 - 2.0 <= 61 * 0.95 - 1 - 2.35


def test_a_noisy_machine_neither_swings_the_plan_nor_ratchets_the_schedule(
    tmp_path, monkeypatch
) -> None:
    """Each 50 steps at a pace drawn from 0.6-1.4x (a shared 2-core machine's windows swing
    so): paced on a window as long as the steps left, the plan is made again a few times, not
    at every check, and the learning rate stays on the cosine laid over the steps the run took
    (plans that swing short and long again, each short one moving the schedule on, once left a
    2-hour run's rate 16% under it half-way through); the run ends in time and uses its budget."""
    rng = random.Random(0)
    swings = [rng.uniform(0.6, 1.4) for _ in range(200)]
    lrs: list[float] = []
    plans, length = run_on_a_fake_clock(
        monkeypatch, tmp_path, 600, lambda s: swings[s // 50], lrs=lrs
    )
    # paced on the latest 50 steps: 74 plans between 3,438 and 5,867 steps, the rate 35% under
    later = plans[2:] or plans[-1:]  # after the first plan and the first epoch end's
    assert len(plans) <= 20 and max(later) <= 1.15 * min(later), plans
    cosine = budget_schedule(load_run_config(None, ["optim.lr=0.001"]), len(lrs), 4)
    # past the warm-up and the first epoch end, up to the last tenth (where the pace is that of
    # the few steps left, and the cosine near 0)
    for s in range(40, int(0.9 * len(lrs))):
        assert lrs[s] == pytest.approx(cosine(s), rel=0.08), s
    assert 600 * 0.9 <= length <= 600


def test_a_stall_costs_its_time_and_not_the_runs_pace(tmp_path, monkeypatch) -> None:
    """One step of 30 s (a process paused with Ctrl-Z, a suspended laptop) at step 300 of a 121 s
    run at 0.1 s a step and 1 s an epoch end every 40 steps (0.125 s a step in all): the plan
    loses the 240 steps that time would have bought, not the 80% that the window's mean pace
    (0.7 s a step) would cut, and the run still ends in time."""
    plans, steady = run_on_a_fake_clock(monkeypatch, tmp_path, 121, lambda s: 1.0)
    plans_stalled, length = run_on_a_fake_clock(
        monkeypatch, tmp_path, 121, lambda s: 300.0 if s == 300 else 1.0
    )
    assert plans_stalled[:2] == plans[:2] and plans[1] > 800
    assert plans[-1] - 250 <= plans_stalled[-1] <= plans[-1] - 230
    assert 121.0 * 0.9 <= length <= 121.0
    # 30 s at an epoch end: step 399 (or 439) and the epoch's end after it take 30 s together;
    # planned for at the check of step 400 (450), or at the pace of the plan when the window
    # since the last plan is too short to pace (25 steps an epoch: the check after step 50's end)
    for stall, spe in ((399, 40), (439, 40), (49, 25)):
        steady, _ = run_on_a_fake_clock(monkeypatch, tmp_path, 121, lambda s: 1.0, spe=spe)
        plans_stalled, length = run_on_a_fake_clock(
            monkeypatch, tmp_path, 121, lambda s, at=stall: 30.0 / 1.1 if s == at else 1.0, spe=spe
        )
        assert steady[-1] - 300 <= plans_stalled[-1] <= steady[-1] - 200, (stall, spe)
        assert 121.0 * 0.85 <= length <= 121.0, (stall, spe)


def test_epochs_longer_than_the_pace_check_still_plan_on_the_measured_epoch_end(
    tmp_path, monkeypatch
) -> None:
    """100 steps an epoch (more than CHECK_EVERY), each epoch end 3 s (validation and
    checkpoints) where the first plan guesses 0.25 s from the steps: the pace check at step 50
    once ended the planning of the first epoch end, so the run planned ~1,040 steps and took
    ~150 s of its 121. Now the first epoch end's cost is measured and planned for (by hand at
    step 100: 18 s gone, the test split 200 * 0.03 + 2 s; (N - 100) * 0.1 + (ceil(N / 100) - 1)
    * 3 <= 121 * 0.95 - 1 - 18 - 8 -> N = 769), and the run ends in time."""
    plans, length = run_on_a_fake_clock(monkeypatch, tmp_path, 121, lambda s: 1.0, spe=100, end=3.0)
    assert plans[0] > 1000  # planned on the guess
    assert plans[1] == 769 and plans[-1] == 769
    assert 121.0 * 0.9 <= length <= 121.0


def test_steps_are_timed_on_the_clock_the_budget_counts() -> None:
    """The steps are timed on a clock that runs with the one the budget counts the command on
    (process_age: wall time since the process started), sleep included where the platform's
    clock counts it, not on CPU time: over 0.3 s asleep both advance 0.3 s."""
    first = clock.step_clock(), clock.process_age()
    time.sleep(0.3)
    steps, age = clock.step_clock() - first[0], clock.process_age() - first[1]
    assert steps == pytest.approx(0.3, abs=0.05) and age == pytest.approx(steps, abs=0.05)


def test_the_process_age_off_linux_counts_the_start_up_too() -> None:
    """Where /proc is missing (macOS), the command's age came from the budget module's import,
    missing the interpreter's and PyTorch's start-up (seconds of a 60 s budget): now from `ps`'s
    elapsed time, which agrees with /proc's to the second here."""
    assert clock.elapsed_seconds("  05:03\n") == 303
    assert clock.elapsed_seconds("1:02:03") == 3723
    assert clock.elapsed_seconds("2-01:02:03") == 2 * 86400 + 3723
    for bad in ("", "12", "2-05:03", "a:b"):
        with pytest.raises(ValueError):
            clock.elapsed_seconds(bad)
    if shutil.which("ps") is None:
        pytest.skip("needs ps")
    script = (  # a command 2.5 s old when it asks, first with /proc, then as without it
        "import time; time.sleep(2.5); from vitlab.train import clock; a = clock.process_age(); "
        "clock.open = lambda *args: (_ for _ in ()).throw(OSError('no /proc')); "
        "print(a, clock.process_age())"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    first, without = map(float, out.stdout.split())
    assert without >= 2.0, without  # not since the module's import (a moment ago)
    if os.path.exists("/proc/self/stat"):  # Linux: the two agree
        assert first >= 2.5 and abs(first - without) <= 1.0, (first, without)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads a parent's /proc")
def test_under_torchrun_the_budget_counts_from_the_launchers_start() -> None:
    """torchrun's own start-up and rendezvous (5-10 s on a loaded 2-core machine) came before
    the worker's start, where the budget counted from: a 30 s budget took 34 s. Under torchrun
    (TORCHELASTIC_RUN_ID) the parent's start counts; not without it, nor a parent that started
    more than LAUNCHER_S before the worker (an agent restarting a failed worker)."""
    child = (
        "from vitlab.train import clock; import sys; clock.LAUNCHER_S = float(sys.argv[1]); "
        "print(clock.process_age() - clock._age(clock.os.getpid()))"
    )  # prints how much earlier than the worker the budget's clock starts
    launcher = (  # 2 s of a launcher's start-up, then its worker: argv child, window, env
        "import os, subprocess, sys, time; time.sleep(2.0); "
        "env = {k: v for k, v in os.environ.items() if k != 'TORCHELASTIC_RUN_ID'}; "
        "env.update(a.split('=', 1) for a in sys.argv[3:]); "
        "subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]], env=env, check=True)"
    )

    def earlier(window: float, *env: str) -> float:
        command = [sys.executable, "-c", launcher, child, str(window), *env]
        return float(subprocess.run(command, capture_output=True, text=True, check=True).stdout)

    assert earlier(120, "TORCHELASTIC_RUN_ID=none") >= 2.0  # the launcher's 2 s counted
    assert earlier(120) == pytest.approx(0, abs=0.05)  # no launcher: the worker's own start
    # a parent that started long before: not this command's start
    assert earlier(1.0, "TORCHELASTIC_RUN_ID=none") == pytest.approx(0, abs=0.05)


def test_a_stall_in_a_first_epoch_longer_than_the_pace_check_costs_its_time(
    tmp_path, monkeypatch
) -> None:
    """100 steps an epoch: an 8 s stall at step 70 (a Ctrl-Z), before the first epoch end, is
    left out of the step's cost that the first epoch end's plan takes from the whole first epoch
    (a stall is a step as long as a pace window's 50 steps together, not an epoch's 100: as one
    of 100 it made the step 0.18 s instead of 0.1 and the plan about half as long); the plan
    loses the ~70 steps the time would have bought."""
    plans, _ = run_on_a_fake_clock(monkeypatch, tmp_path, 121, lambda s: 1.0, spe=100)
    stalled, length = run_on_a_fake_clock(
        monkeypatch, tmp_path, 121, lambda s: 80.0 if s == 70 else 1.0, spe=100
    )
    assert plans[-1] - 90 <= stalled[-1] <= plans[-1] - 55, (plans, stalled)
    assert 121.0 * 0.9 <= length <= 121.0


def test_the_steps_are_observed_once_though_asked_for_each_parameter_group(
    tmp_path, monkeypatch
) -> None:
    """The engine asks for the learning rate once per parameter group (two: decayed and not):
    the budget times and plans once a step, so a run asked twice plans as one asked once."""
    calls: list[int] = []
    original = TimeBudget._plan
    monkeypatch.setattr(TimeBudget, "_plan", lambda self, step, *a, **k: (
        calls.append(step), original(self, step, *a, **k))[1])  # fmt: skip
    cfg = load_run_config(None, ["train.time_budget=31s", "optim.lr=0.001"])
    now = [0.0]
    monkeypatch.setattr(clock, "step_clock", lambda: now[0])
    monkeypatch.setattr(clock, "process_age", lambda: 5.0 + now[0])
    for asks in (1, 2):
        settings = StepSettings(1, None, lambda step: 0.5, nullcontext)
        (tmp_path / str(asks)).mkdir()
        TimeBudget(cfg, settings, 40, 4, (64, 100, 200), tmp_path / str(asks), Dist())
        calls.clear()
        for step in range(300):
            for _ in range(asks):
                settings.lr_at(step)
            now[0] += 0.1 + (1.0 if (step + 1) % 40 == 0 else 0.0)
        if asks == 1:
            once = list(calls)
    # the first plan, the first epoch end's, then every 50 steps
    assert once == [23, 40, 50, 100, 150, 200, 250] and calls == once


def test_a_plan_written_before_schedules_were_anchored_resumes_on_its_own_steps(tmp_path):
    """A time_budget.json without "schedule" (vitlab before plans could stretch the schedule):
    the resumed run's schedule is laid over the plan's steps, as it was then."""
    cfg = load_run_config(None, ["train.time_budget=1m", "optim.lr=0.001"])
    (tmp_path / "time_budget.json").write_text(json.dumps({"steps": 300, "final": True}))
    settings = StepSettings(1, None, lambda step: 0.5, nullcontext)
    TimeBudget(cfg, settings, 40, 4, (64, 100, 200), tmp_path, Dist(), resumed=True)
    expected = budget_schedule(cfg, 300, 4)
    assert settings.max_steps == 300 and cfg.train.epochs == 8
    for step in (0, 3, 10, 150, 299, 300):
        assert settings.lr_at(step) == pytest.approx(expected(step), abs=1e-15)


def test_a_damaged_plan_is_said_naming_its_file(tmp_path: Path) -> None:
    """A time_budget.json that is not a plan (bytes, not JSON, no steps) was a decoder's message
    without the file's name, or a KeyError traceback (a QA pass)."""
    cfg = load_run_config(None, ["train.time_budget=1m"])
    for damaged in (b"\x80\x04\x95pickle", b"not json", b"{}", b"[1]", b'{"steps": "x"}'):
        (tmp_path / "time_budget.json").write_bytes(damaged)
        settings = StepSettings(1, None, lambda step: 0.5, nullcontext)
        with pytest.raises(CheckpointError, match="time_budget.json, the run's time-budget plan, "
                                                  "is damaged"):  # fmt: skip
            TimeBudget(cfg, settings, 40, 4, (64, 100, 200), tmp_path, Dist(), resumed=True)


def cpu_seconds() -> float:
    """CPU seconds (user + system) the finished child processes of this one have used."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def spent_at_start(steps: int, wall: float | None) -> None:
    """Skip when the planned steps are the fewest possible: start-up alone took the budget (a
    machine so loaded that nothing here can be measured)."""
    if steps <= budget.SKIP_STEPS + budget.TIMED_STEPS + 1:
        pytest.skip(f"start-up took the whole budget on this machine (wall {wall} s)")


@pytest.mark.serial
def test_a_budgeted_run_ends_in_time_and_says_what_it_bought(tmp_path: Path) -> None:
    out, seconds = tmp_path / "run", 20
    t, cpu = time.perf_counter(), cpu_seconds()
    r = subprocess.run(
        [*VITLAB, "train", "--out", str(out),
         f"train.time_budget={seconds}s", "train.threads=1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    wall, cpu = time.perf_counter() - t, cpu_seconds() - cpu
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads((out / "time_budget.json").read_text())
    steps = plan["steps"]
    if wall > seconds + 3 and cpu < wall / 2:  # it ran less than half the time: starved
        pytest.skip(f"the machine is too busy to time a run: {cpu:.0f} s of CPU in {wall:.0f} s")
    log = f"{wall:.1f} s wall, {cpu:.1f} s CPU, plan {plan}\n{r.stderr[-3000:]}"  # for a failure
    assert wall <= seconds + 3, log
    assert f"time budget {seconds}s: {steps:,} steps (" in r.stderr, log
    assert load_train_state(out / "checkpoints" / "last")["step"] == steps, log
    epochs = len((out / "metrics.jsonl").read_text().splitlines())
    assert epochs == math.ceil(steps / 20), log  # digits: 1,294 training images, 20 batches of 64
    # the progress bar counts no epochs before the plan, then the plan's (not train.epochs' 40)
    assert "epoch 1/?" in r.stderr and f"epoch {epochs}/{epochs}" in r.stderr, log
    assert json.loads((out / "results.json").read_text())["top1"] > 0.3, log


def test_a_resumed_run_keeps_its_plan(tmp_path: Path, monkeypatch, capsys) -> None:
    """Stopped after epoch 2 of a 10-minute plan, resumed for one more epoch: the plan is kept,
    not made again. In this process, whose age is counted from the test's start. (10 minutes, of
    which the test trains 3 short epochs: a plan of more than 3 epochs however loaded the
    machine.)"""
    t0 = time.perf_counter()
    monkeypatch.setattr(clock, "process_age", lambda: time.perf_counter() - t0)
    out = tmp_path / "run"
    first = ["train", "--out", str(out), *TINY_MODEL, "train.time_budget=10m",
             "train.stop_at_epoch=2"]  # fmt: skip
    assert main(first) == 0
    plan = (out / "time_budget.json").read_text()
    steps = json.loads(plan)["steps"]
    spent_at_start(steps, None)
    assert steps > 60 and load_train_state(out / "checkpoints" / "last")["step"] == 40
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "train.stop_at_epoch=3"]) == 0
    err = capsys.readouterr().err
    assert f"time budget 10m: resumed, keeping the run's plan of {steps:,} steps" in err
    assert "img/s (planned" not in err and (out / "time_budget.json").read_text() == plan
    assert load_train_state(out / "checkpoints" / "last")["step"] == 60


def test_an_in_process_call_counts_from_the_call(tmp_path: Path, monkeypatch) -> None:
    """train() in a long-lived process (a notebook, vitlab reproduce) counts the budget from the
    call, not from the process's start: a process 20 minutes old still gets a 10-minute plan
    (counted from its start, the plan would be the fewest steps). The command counts from the
    process's start (test_a_resumed_run_keeps_its_plan)."""
    t0 = time.perf_counter()
    monkeypatch.setattr(clock, "process_age", lambda: 1200.0 + time.perf_counter() - t0)
    cfg = load_run_config(None, [*TINY_MODEL, "train.time_budget=10m", "train.stop_at_epoch=2"])
    train(cfg, out=tmp_path / "run")
    steps = json.loads((tmp_path / "run" / "time_budget.json").read_text())["steps"]
    assert steps > 60  # not spent_at_start's skip: counted from the process, this is the case


def test_a_budget_shorter_than_the_run_can_be_says_so(tmp_path: Path, capsys) -> None:
    """A 1 s budget cannot hold start-up, the planning steps and the test: the run takes what it
    must (one more step) and its plan line says how far past the budget it ends (once silent)."""
    args = ["train", "--out", str(tmp_path / "r"), *TINY_MODEL, "train.time_budget=1s"]
    assert main(args) == 0
    err = capsys.readouterr().err
    said = re.findall(r"time budget 1s: [^\r\n]*", err)  # (after a progress bar's start)
    assert said and all("the budget is too short for this run: it ends about" in x for x in said)
    assert json.loads((tmp_path / "r" / "time_budget.json").read_text())["final"]
