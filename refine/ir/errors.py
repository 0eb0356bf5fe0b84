"""Errors about a check's input, raised by whichever stage finds the problem.

The loader finds most of them, but lowering, relating and rule verification find some too
(a rank graph whose op cannot lower, a relation that places the wrong shape), so the type
lives below every stage. The CLI reports one with exit status 2.
"""

from __future__ import annotations


class InputError(ValueError):
    """Something wrong with an input file: which file, where in it (a JSON path, or a place
    the reader can find), and why."""

    def __init__(self, file: str, where: str, reason: str) -> None:
        super().__init__(f"{file}: {where}: {reason}")
        self.file, self.where, self.reason = file, where, reason
