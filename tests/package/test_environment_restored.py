"""A test's environment variables do not reach the next test (tests/conftest.py).

The two tests run in file order: the first writes a rendezvous into the environment as
Lightning's strategies do; the second would then find it and ``launch`` would use it.
"""

from __future__ import annotations

import os

KEYS = ("MASTER_PORT", "RANK", "WORLD_SIZE")
BEFORE = {key: os.environ.get(key) for key in KEYS}


def test_a_test_writes_a_rendezvous() -> None:
    os.environ.update(MASTER_PORT="38385", RANK="0", WORLD_SIZE="1")


def test_the_next_test_does_not_see_it() -> None:
    assert {key: os.environ.get(key) for key in KEYS} == BEFORE
