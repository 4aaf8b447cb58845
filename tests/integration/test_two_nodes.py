"""Two torchrun agents on this machine, as two nodes of two ranks, run the examples unchanged.

``examples/fsdp2_train.py`` (plain PyTorch) and ``examples/fsdp2_hsdp.py`` (a ``launch``
training function) train on four ranks spread over two "nodes" exactly as on one: same losses
to the last digit, ranks laid out node by node, HSDP's shard groups inside a node and its
replicate groups across nodes, and every collective's bytes as predicted.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import pytest
from hsdp_reference import hsdp_prediction, unsharded_losses
from torchrun_nodes import ROOT, Job, Nodes, run_together

from fsdp_guide import launch

sys.path.insert(0, str(ROOT / "examples"))
import fsdp2_hsdp
import fsdp2_train_elastic

LOSS = re.compile(r"step (\d+): loss ([0-9.]+)")
STEPS = 3
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@dataclass(frozen=True)
class Runs:
    """Both examples on two nodes, and the same trainings on one node, forked from here."""

    plain: Nodes
    hsdp: Nodes
    hsdp_ranks: list[dict[str, Any]]
    plain_one_node: list[float]
    hsdp_one_node: list[dict[str, Any]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    tmp = tmp_path_factory.mktemp("two_nodes")
    report = tmp / "ranks.json"

    def one_node() -> tuple[list[float], list[dict[str, Any]]]:
        # The plain script's training as a launch function: the elastic example (same model,
        # data, sharding and optimizer, so the same losses).
        plain = launch(
            fsdp2_train_elastic.train,
            4,
            args=(STEPS, STEPS, str(tmp / "ckpt")),
            start_method="fork",
        )
        return plain[0], launch(fsdp2_hsdp.train, 4, args=(STEPS, 2), start_method="fork")

    (plain, hsdp), references = run_together(
        [
            Job(ROOT / "examples" / "fsdp2_train.py", ("--steps", str(STEPS))),
            Job(
                ROOT / "examples" / "fsdp2_hsdp.py", ("--steps", str(STEPS), "--json", str(report))
            ),
        ],
        during=one_node,  # while the agents start their ranks
    )
    assert references is not None
    return Runs(plain, hsdp, json.loads(report.read_text()), *references)


def test_plain_script_on_two_nodes_trains_as_on_one(runs: Runs) -> None:
    lines = runs.plain.lines()
    losses = [float(m[2]) for _, text in lines if (m := LOSS.fullmatch(text.strip()))]
    assert losses == [round(x, 6) for x in runs.plain_one_node]
    assert len(losses) == STEPS
    # torchrun ignores --node-rank with the c10d rendezvous, and says so.
    assert "node_rank is only used for static rdzv_backend" in runs.plain.output()


def test_ranks_are_laid_out_node_by_node(runs: Runs) -> None:
    ranks, nodes = runs.hsdp_ranks, runs.hsdp
    agent_of = nodes.agent_of
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    by_agent: dict[int, list[int]] = defaultdict(list)
    for r in ranks:
        by_agent[agent_of[r["pid"]]].append(r["rank"])
        assert r["local_rank"] == r["rank"] % 2
        assert r["node"] == r["rank"] // 2  # GROUP_RANK: the agent's place in the rendezvous
    # Each agent started two consecutive ranks, all of one node. Which agent became node 0 is
    # the rendezvous's choice, not --node-rank's: it sorts the agents by address, then pid.
    assert sorted(sorted(v) for v in by_agent.values()) == [[0, 1], [2, 3]]
    first = min(nodes.agents, key=lambda a: a.process.pid).node
    assert sorted(by_agent[first]) == [0, 1]
    for r in ranks:
        assert len({agent_of[ranks[o]["pid"]] for o in r["shard_group"]}) == 1  # one node
        assert len({agent_of[ranks[o]["pid"]] for o in r["replicate_group"]}) == 2  # both
        assert r["shard_group"] == [r["rank"] // 2 * 2, r["rank"] // 2 * 2 + 1]
        assert r["replicate_group"] == [r["rank"] % 2, r["rank"] % 2 + 2]


def test_hsdp_on_two_nodes_trains_as_on_one_and_as_unsharded(runs: Runs) -> None:
    ranks, one_node = runs.hsdp_ranks, runs.hsdp_one_node
    assert [r["losses"] for r in ranks] == [r["losses"] for r in one_node]
    assert [r["collectives"] for r in ranks] == [r["collectives"] for r in one_node]
    # Every rank sees its share of the same global batch: the mean loss is the unsharded one.
    assert ranks[0]["losses"] == pytest.approx(unsharded_losses(STEPS), rel=1e-6, abs=1e-6)


def test_hsdp_bytes_per_rank_and_per_collective_match_the_prediction(runs: Runs) -> None:
    ranks = runs.hsdp_ranks
    predicted = hsdp_prediction(nodes=2, ranks_per_node=2)
    for r in ranks:
        assert r["model_state"] == predicted.state.as_dict()
        measured = {
            ("within node" if c["ranks"] == r["shard_group"] else "across nodes", c["kind"]): (
                c["calls"],
                c["bytes"],
            )
            for c in r["collectives"]
        }
        assert measured == predicted.collectives
