"""Fail fast for the commands that poll a target (`diagnose --target`,
`capture`): the first failed poll is reported at once, in the sidecar's one
sentence (each new reason once, and a recovery), and the command stops after
a stated number of failed polls in a row unless told to keep trying."""

from __future__ import annotations

import argparse

from kvwatch.present import TerminalText, TextOut

DEFAULT_MAX_FAILURES = 3


def add_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--max-failures", type=int, default=DEFAULT_MAX_FAILURES, metavar="N",
                        help=f"stop {what} after N failed polls in a row (default {DEFAULT_MAX_FAILURES}); "
                             "each failure is reported as it happens")
    parser.add_argument("--keep-trying", action="store_true",
                        help="never stop for failed polls: poll for the whole --duration (an engine still starting)")


def limit_of(args: argparse.Namespace) -> tuple[int | None, str | None]:
    """(failures in a row to stop at, or None to keep trying; a problem with the flags)."""
    if args.keep_trying:
        return None, None
    if args.max_failures < 1:
        return None, "--max-failures must be at least 1 (or give --keep-trying)"
    return args.max_failures, None


class FailureReport:
    """Counts failed polls in a row; prints a failure as it happens (its
    sentence once per new reason), a recovery, and whether to give up."""

    def __init__(self, out: TextOut, prefix: str, limit: int | None):
        # A failure's sentence may quote what the engine sent: escapes written out.
        self.out = TerminalText(out)
        self.prefix = prefix
        self.limit = limit
        self.in_a_row = 0
        self.failed_polls = 0
        self._said: str | None = None
        self.last_sentence: str | None = None
        self.gave_up = False

    def failed(self, poll: int, reason: str, sentence: str) -> bool:
        """Record a failed poll (numbered from 1); True when it is time to stop."""
        self.in_a_row += 1
        self.failed_polls += 1
        self.last_sentence = sentence
        if reason != self._said:
            self._said = reason
            print(f"{self.prefix}: poll {poll} failed: {sentence}", file=self.out, flush=True)
        if self.limit is not None and self.in_a_row >= self.limit:
            self.gave_up = True
        return self.gave_up

    def succeeded(self, poll: int) -> None:
        if self.in_a_row:
            print(f"{self.prefix}: poll {poll} succeeded after {self.in_a_row} failed", file=self.out, flush=True)
        self.in_a_row = 0
        self._said = None

    def gave_up_text(self) -> str:
        return (f"stopped after {self.limit} failed polls in a row (--max-failures {self.limit}; "
                "--keep-trying polls for the whole --duration)")
