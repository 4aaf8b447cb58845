"""The Llama-3 8B/70B answer on "Will it fit?" is ``estimate``'s own output, and holds together.

The page quotes the commands and what they printed (planning Llama-3-70B takes minutes, so
the output is pasted rather than run at build time). Here the commands are parsed by the
command line's own parser, each quoted table adds up (every column before ``total`` is in
it), the recommended strategy's peak fits, and the closing note gives every strategy a row.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fsdp_guide.catalog import STRATEGIES
from fsdp_guide.cli import build_parser

PAGE = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "will_it_fit.md").read_text()
SECTION = PAGE[PAGE.index("## Llama-3-8B on one node") :]
SECTION = SECTION[: SECTION.index("\n## ", 1)]
SCALE = {"KB": 1e3, "MB": 1e6, "GB": 1e9}


def _commands() -> list[list[str]]:
    """The ``estimate`` commands of the section, their ``$L8``/``$L70`` expanded."""
    blocks = re.findall(r"```console\n(.*?)```", SECTION, re.DOTALL)
    text = "\n".join(blocks).replace("\\\n", " ")
    names = dict(re.findall(r'^\$ (L\d+)="([^"]+)"', text, re.MULTILINE))
    commands = []
    for line in re.findall(r"^\$ python -m fsdp_guide (estimate .*)$", text, re.MULTILINE):
        for name, value in names.items():
            line = line.replace(f"${name}", value)
        commands.append(shlex.split(line))
    return commands


def _tables() -> list[str]:
    return re.findall(r"```text\n(.*?)```", SECTION, re.DOTALL)


def test_the_commands_are_the_command_lines_own() -> None:
    commands = _commands()
    assert len(commands) == 2
    eight, seventy = (build_parser().parse_args(c) for c in commands)
    assert (eight.world_size, eight.seq_len, eight.precision) == (8, 4096, "mixed")
    assert (seventy.world_size, seventy.gpus_per_node) == (32, 8)
    for args in (eight, seventy):
        assert args.max_batch and args.activation_checkpointing == "blocks"
        assert args.gpu_memory == 80 * 10**9


@pytest.mark.parametrize("index", [0, 1], ids=["8B", "70B"])
def test_each_quoted_table_adds_up_and_its_recommendation_fits(index: int) -> None:
    lines = _tables()[index].strip().splitlines()
    header = lines[1].split()
    added = header[1 : header.index("total")]
    assert added == ["params", "grads", "optimizer", "master", "buckets", "activations",
                     "transient"]  # fmt: skip
    rows = {c[0]: c for c in (line.split() for line in lines[2:]) if c and c[0] in STRATEGIES}
    assert list(rows) == list(STRATEGIES)
    for name, cells in rows.items():
        value = [float(cells[1 + 2 * i]) * SCALE[cells[2 + 2 * i]] for i in range(len(added) + 2)]
        # Each column is rounded to 0.01 of its unit: the sum is the total within those.
        assert abs(sum(value[: len(added)]) - value[len(added)]) <= 0.01e9 * len(added), name
    best = re.search(r"^recommended: (\w+)", _tables()[index], re.MULTILINE)
    assert best is not None
    fits = rows[best[1]][1 + 2 * (len(added) + 5)]  # after total, peak, host, payload, wire
    assert fits == "yes"
    assert "recipe: examples/recipes/" in _tables()[index]


def test_the_closing_note_gives_every_strategy_before_and_after() -> None:
    note = SECTION[SECTION.index("**What changed in these answers.**") :]
    tables = re.findall(r"((?:^\|.*\n)+)", note, re.MULTILINE)
    assert len(tables) == 2  # 8B on 8 GPUs, 70B on 32
    for table in tables:
        assert set(re.findall(r"^\| (\w+) \|", table, re.MULTILINE)) == {*STRATEGIES, "strategy"}
