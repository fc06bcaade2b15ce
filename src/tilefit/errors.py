"""The one error type tilefit raises for bad input.

Every message says what was expected, what was given, and the fix, so that the CLI can print
it and exit with code 2 instead of showing a traceback.
"""

from __future__ import annotations


class TilefitError(Exception):
    """Bad input or an unsupported situation, explained for a person.

    ``str(err)`` is the full message: the problem, then ``expected``, ``given`` and ``fix``
    lines where they were supplied.
    """

    def __init__(
        self,
        problem: str,
        *,
        expected: str | None = None,
        given: str | None = None,
        fix: str | None = None,
    ) -> None:
        self.problem = problem
        self.expected = expected
        self.given = given
        self.fix = fix
        super().__init__(self.message)

    @property
    def message(self) -> str:
        lines = [self.problem]
        if self.expected is not None:
            lines.append(f"  expected: {self.expected}")
        if self.given is not None:
            lines.append(f"  given:    {self.given}")
        if self.fix is not None:
            lines.append(f"  fix:      {self.fix}")
        return "\n".join(lines)


def error_line(err: BaseException) -> str:
    """An error in one line, for a note: a TilefitError's problem, another error's type and
    the first line of its message."""
    if isinstance(err, TilefitError):
        return err.problem.splitlines()[0] if err.problem else "TilefitError"
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def check_positive_int(value: object, problem: str, *, expected: str, fix: str) -> int:
    """``value`` when it is a whole number >= 1 (a bool is not one), else a TilefitError with
    ``problem``, ``expected`` and ``fix``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TilefitError(problem, expected=expected, given=repr(value), fix=fix)
    return value


def close_matches(word: str, candidates: list[str], n: int = 3) -> list[str]:
    """The candidates nearest to ``word`` (difflib's ratio), best first."""
    import difflib

    lowered = {c.lower(): c for c in candidates}
    hits = difflib.get_close_matches(word.lower(), list(lowered), n=n, cutoff=0.5)
    return [lowered[h] for h in hits]
