"""The exit codes docs/operations.md tells operators about are the ones the
processes use, all of them."""

from __future__ import annotations

import re
from pathlib import Path

from protocol.exit_codes import ExitCode

OPERATIONS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
_TABLE_ROW = re.compile(r"^\| (\d+) \| [^|]+ \| [^|]+ \|$", re.MULTILINE)


def documented_codes() -> list[int]:
    table = OPERATIONS.read_text().split("What an exit code says", 1)[1].split("\n\n")[1]
    return [int(code) for code in _TABLE_ROW.findall(table)]


def test_the_operations_table_lists_every_exit_code_once() -> None:
    assert documented_codes() == sorted(code.value for code in ExitCode)
