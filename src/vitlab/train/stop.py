"""Stopping a run on request: the first Ctrl-C or SIGTERM lets it finish the step and save."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from vitlab.runtime import first_rank, handling


class StopFlag:
    """First Ctrl-C (SIGINT) or SIGTERM: finish the step, save, exit. Second Ctrl-C: stop now.

    In a distributed run the save needs every rank: if a rank is lost the next collective fails
    (at once, or after the collective timeout), nothing is saved and the last epoch's checkpoint
    stands. Leaving on an error there, SIGTERM is ignored from then on: torchrun's agent sends it
    to every survivor as soon as one rank dies, and it would cut short the report of which rank
    was lost (see vitlab.train.distributed.raise_if_rank_lost); the process is ending anyway."""

    def __init__(self, distributed: bool = False) -> None:
        self.requested, self.distributed = False, distributed
        self.signum = signal.SIGINT  # the first signal's, once requested

    def __enter__(self) -> StopFlag:
        if getattr(self, "_handling", None) is not None:
            raise RuntimeError("this StopFlag is in use: a block takes a flag of its own")
        self.requested, self._pid = False, os.getpid()
        self._handling = handling((signal.SIGINT, signal.SIGTERM), self._handle)
        self._old = self._handling.__enter__()
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if os.getpid() != self._pid:  # a loader worker forked with it: the main process stops
            return
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.requested:  # the first signal's number is the exit code's
            self.signum = signal.Signals(signum)
        self.requested = True
        note = " (if every rank is still there)" if self.distributed else ""
        if first_rank(local=True):  # torchrun signals every rank: one a machine says it
            print(f"\nstop requested: saving a checkpoint after this step{note} ...",
                  file=sys.stderr)  # fmt: skip

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        failed = exc_type is not None and not issubclass(exc_type, TrainingStopped)
        if failed and self.distributed and signal.SIGTERM in self._old:
            self._old[signal.SIGTERM] = signal.SIG_IGN
        self._handling.__exit__(None, None, None)
        self._handling = None


class TrainingStopped(RuntimeError):
    """The run was stopped on request after saving a checkpoint: `where` (the epoch and batch),
    and in the message how to continue it (`command`: distributed.resume_command), if given.
    `signum`: the signal that asked (the command exits 128 + it, as the signal's default would)."""

    def __init__(self, where: str, command: str | None = None, signum: int = signal.SIGINT):
        self.where, self.signum = where, signum
        super().__init__(f"{where}: continue with {command}" if command else where)


def failed_on_stop(
    error: Exception, epoch: int, out: Path, command: str, signum: int
) -> TrainingStopped:
    """A step of `epoch` that failed after a stop signal, which reached the processes it needed
    too (a signal to the process group: Ctrl-C, `timeout`, a scheduler; torch.compile's compiler
    workers and gcc die with it): the stop said in a line, not the failure's traceback."""
    lines = [x.strip() for x in str(error).splitlines() if x.strip()]  # gcc's output follows
    said = next((x for x in lines if not x.endswith(":")), "")[:200]  # not "backend raised:"
    why = (f"stopped at epoch {epoch}: the step failed after the stop signal, which may have "
           f"reached the processes it needed too (torch.compile's compiler workers and gcc get "
           f"the process group's signals): {type(error).__name__}{': ' * bool(said)}{said}; "
           f"nothing after the last checkpoint is saved")  # fmt: skip
    if (out / "checkpoints" / "last").exists():
        return TrainingStopped(why, command, signum)
    return TrainingStopped(f"{why}, and there is none yet: start the run again", None, signum)
