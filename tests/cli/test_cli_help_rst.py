"""The site renders every command's description, epilog and option help as
reStructuredText (the argparse directive of docs/cli.md): each must parse without a warning,
or the strict docs build fails on a line with no file name."""

from __future__ import annotations

import argparse
import io

import docutils.core
import pytest

from fsdp_guide.cli import build_parser


def _texts(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, str]]:
    found = [(f"{path} description", parser.description), (f"{path} epilog", parser.epilog)]
    for action in parser._actions:
        found.append((f"{path} {'/'.join(action.option_strings) or action.dest}", action.help))
        if isinstance(action.choices, dict):
            for name, sub in action.choices.items():
                found += _texts(sub, f"{path} {name}")
    return [(label, text) for label, text in found if isinstance(text, str) and text]


TEXTS = _texts(build_parser(), "python -m fsdp_guide")


@pytest.mark.parametrize(("label", "text"), TEXTS, ids=[label for label, _ in TEXTS])
def test_help_text_is_clean_restructuredtext(label: str, text: str) -> None:
    warnings = io.StringIO()
    docutils.core.publish_doctree(
        text, settings_overrides={"report_level": 2, "warning_stream": warnings, "halt_level": 5}
    )
    assert warnings.getvalue() == "", label
