"""What every benchmark page in ``docs/benchmarks/`` starts with: the date and the command."""

from __future__ import annotations

import datetime
import pathlib
import shlex
import sys


def command_line(script: str, argv: list[str] | None = None) -> str:
    """``python benchmarks/<script> <arguments>``, as it was run (``argv``: ``sys.argv[1:]``)."""
    arguments = sys.argv[1:] if argv is None else argv
    return f"python benchmarks/{script}" + "".join(" " + shlex.quote(a) for a in arguments)


def page_header(command: str, setting: str | None = None) -> list[str]:
    """Markdown lines: when and with which command the page was measured, then the setting."""
    lines = [
        f"Measured on {datetime.date.today().isoformat()} with:",
        "",
        "```console",
        f"$ {command}",
        "```",
        "",
    ]
    return lines + ([f"{setting}.", ""] if setting else [])


def write_page(path: pathlib.Path, lines: list[str]) -> None:
    """Write a page's markdown lines to ``path`` (folders made as needed) and say so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {path}")
