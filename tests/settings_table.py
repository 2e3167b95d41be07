"""docs/operations.md's table of every setting, written from the config classes
that read them (their defaults and help), so that the table cannot drift:
tests/test_settings_table.py fails when it has.

    python -m tests.settings_table           # print the table
    python -m tests.settings_table --write   # put it in docs/operations.md
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from frontend.config import FrontendConfig
from protocol.client_config import WorkerClientConfig
from worker.engine.fake_engine import FakeEngineConfig
from worker.launch.config import SupervisorConfig
from worker.serve.config import WorkerConfig

OPERATIONS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
BEGIN = "<!-- settings table: python -m tests.settings_table --write -->"
END = "<!-- end of settings table -->"

# Each config class and the process that reads it. The worker-client settings
# (FrontendConfig and SupervisorConfig inherit them) are read by whatever talks
# to workers.
READERS: tuple[tuple[type[Any], str], ...] = (
    (WorkerConfig, "worker"),
    (FakeEngineConfig, "worker (`MODEL_ID=fake`)"),
    (FrontendConfig, "frontend"),
    (SupervisorConfig, "supervisor"),
)


def _default(field: dataclasses.Field[Any]) -> str:
    value = field.default
    if isinstance(value, bool):
        return str(int(value))
    if value == "":
        return "unset"
    if isinstance(value, float):
        return f"{value:g}"
    return f"`{value}`" if isinstance(value, str) else str(value)


def rows() -> dict[str, tuple[list[str], str, str]]:
    """Each variable: the processes that read it, its default and its help."""
    table: dict[str, tuple[list[str], str, str]] = {}
    client_fields = {field.name for field in dataclasses.fields(WorkerClientConfig)}
    for config, reader in READERS:
        for field in dataclasses.fields(config):
            env = field.metadata["env"]
            if env == "WORKER_ENDPOINTS":  # the supervisor starts its own workers
                reader_here = "frontend (`minibatch-serve` refuses it)"
            elif config is not WorkerConfig and field.name in client_fields:
                reader_here = "frontend, supervisor"
            else:
                reader_here = reader
            readers, _, _ = table.setdefault(
                env, ([], _default(field), field.metadata["help"].replace("|", "\\|"))
            )
            if reader_here not in readers:
                readers.append(reader_here)
    return table


def markdown() -> str:
    lines = ["| variable | read by | default | meaning |", "|---|---|---|---|"]
    for env, (readers, default, help_text) in rows().items():
        lines.append(f"| `{env}` | {', '.join(readers)} | {default} | {help_text} |")
    return "\n".join([BEGIN, *lines, END])


def documented() -> str:
    """The table as docs/operations.md has it now."""
    text = OPERATIONS.read_text()
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def write() -> None:
    text = OPERATIONS.read_text()
    OPERATIONS.write_text(text.replace(documented(), markdown()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update docs/operations.md")
    if parser.parse_args().write:
        write()
    else:
        print(markdown())
