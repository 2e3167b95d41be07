"""docs/operations.md's table of every setting, and README.md's of the main ones,
written from the config classes that read them (their defaults and help), so
that neither can drift: tests/test_settings_table.py fails when one has.

    python -m tests.settings_table           # print the whole table
    python -m tests.settings_table --write   # put both tables in their files
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from frontend.config import FrontendConfig
from worker.engine.fake_engine import FakeEngineConfig
from worker.launch.config import SupervisorConfig
from worker.serve.config import WorkerConfig

REPO = Path(__file__).resolve().parent.parent
OPERATIONS = REPO / "docs" / "operations.md"
README = REPO / "README.md"
BEGIN = "<!-- settings table: python -m tests.settings_table --write -->"
END = "<!-- end of settings table -->"
# The settings README.md shows, in this order: a first deployment's.
MAIN_SETTINGS = (
    "MODEL_ID",
    "MAX_BATCH_SIZE",
    "DTYPE",
    "WEIGHTS",
    "HOST",
    "PORT",
    "WORKER_ENDPOINT",
    "NUM_WORKERS",
    "TORCH_THREADS",
    "MAX_NEW_TOKENS_LIMIT",
    "REQUEST_TIMEOUT_S",
    "API_KEY",
)

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
    """Each variable: the processes that read it, its default and its help (each
    process's, where they word it apart: NUM_WORKERS is how many a supervisor
    runs, and how many share the memory to a worker)."""
    table: dict[str, tuple[list[str], str, dict[str, list[str]]]] = {}
    for config, process in READERS:
        for field in dataclasses.fields(config):
            env, help_text = field.metadata["env"], field.metadata["help"]
            reader = process
            if env == "WORKER_ENDPOINTS":  # the supervisor starts its own workers
                if config is SupervisorConfig:
                    continue
                reader = "frontend (`minibatch-serve` refuses it)"
            readers, _, helps = table.setdefault(env, ([], _default(field), {}))
            for names in (readers, helps.setdefault(help_text.replace("|", "\\|"), [])):
                if reader not in names:
                    names.append(reader)
    return {
        env: (readers, default, _meaning(helps)) for env, (readers, default, helps) in table.items()
    }


def _meaning(helps: dict[str, list[str]]) -> str:
    """One help, or each reader's (help -> the readers that give it)."""
    if len(helps) == 1:
        return next(iter(helps))
    return "; ".join(f"{', '.join(readers)}: {help_text}" for help_text, readers in helps.items())


def markdown(only: tuple[str, ...] | None = None) -> str:
    """The table of every setting, or of ``only`` these, in their order."""
    table = rows()
    lines = ["| variable | read by | default | meaning |", "|---|---|---|---|"]
    for env in only or table:
        readers, default, help_text = table[env]
        lines.append(f"| `{env}` | {', '.join(readers)} | {default} | {help_text} |")
    return "\n".join([BEGIN, *lines, END])


def documented(path: Path = OPERATIONS) -> str:
    """The table as ``path`` has it now."""
    text = path.read_text()
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def write() -> None:
    for path, only in ((OPERATIONS, None), (README, MAIN_SETTINGS)):
        text = path.read_text()
        path.write_text(text.replace(documented(path), markdown(only)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help="update docs/operations.md and README.md"
    )
    if parser.parse_args().write:
        write()
    else:
        print(markdown())
