"""The table ``sparkdl doctor`` prints: one :class:`Check` per row, then every problem with its fix."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

OK, INFO, WARN, ERROR = "ok", "info", "warn", "ERROR"


@dataclass
class Check:
    """One row of the doctor's table, and what to do about it when it is not ok."""

    name: str
    status: str
    driver: str = ""
    executors: str = ""
    problem: str = ""
    fix: str = ""


@dataclass
class Report:
    """The doctor's rows in the order they were checked; :meth:`render` is what it prints."""

    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, status: str, driver: str = "", executors: str = "", problem: str = "", fix: str = "") -> Check:
        """Appends a row and returns it, so that a later check can fill in its executors' column."""
        check = Check(name, status, driver, executors, problem, fix)
        self.checks.append(check)
        return check

    def set(self, name: str, status: str, problem: str, fix: str) -> None:
        """Overrides the verdict of the row(s) named ``name``, keeping what they show."""
        for c in self.checks:
            if c.name == name:
                c.status, c.problem, c.fix = status, problem, fix

    def errors(self) -> list[Check]:
        """The rows whose status is an error: any makes the doctor exit 1."""
        return [c for c in self.checks if c.status == ERROR]

    def render(self) -> str:
        """The table, then "What to look at:" with each problem and its fix, then the counts."""
        header = ("check", "driver", "executors", "status")
        rows = [header, *((c.name, c.driver, c.executors, c.status) for c in self.checks)]
        widths = [min(max(len(r[i]) for r in rows), 64) for i in range(3)]

        def cut(text: str, width: int) -> str:
            return text if len(text) <= width else text[: width - 1] + "…"

        lines = ["  ".join(cut(r[i], widths[i]).ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        problems = [c for c in self.checks if c.problem]
        if problems:
            lines += ["", "What to look at:"]
            for c in problems:
                lines.append(f"  [{c.status}] {c.name}: {c.problem}")
                if c.fix:
                    lines.append(f"      fix: {c.fix}")
        n_err = len(self.errors())
        n_warn = sum(c.status == WARN for c in self.checks)
        lines += ["", f"{n_err} error(s), {n_warn} warning(s)" + ("" if n_err else ": ready to run sparkdl")]
        return "\n".join(lines)


def version_tuple(version: str) -> tuple[int, ...]:
    """The first three numbers of a version string: ``"2.5.1+cpu"`` -> ``(2, 5, 1)``."""
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])
