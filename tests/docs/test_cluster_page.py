"""The guide page "From a notebook to a cluster" is built, reachable, and shows what it promises.

It reads the built HTML (the ``site`` fixture of ``test_docs_site`` builds it when stale).
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from hsdp_reference import hsdp_prediction
from test_docs_site import site  # noqa: F401  (the fixture that builds the site)

ROOT = Path(__file__).resolve().parents[2]


def _text(path: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", path.read_text()))


@pytest.mark.parametrize(
    "shown",
    [
        'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1',  # the SLURM script itself
        "def train(",  # the training function, from the example
        "--rdzv-endpoint gpu-017:29400",  # the command srun runs on each node
        "TORCHELASTIC_RESTART_COUNT",  # the table of variables
        "GROUP_RANK",
        "SLURM_JOB_NODELIST",
        'mesh_dim_names=("replicate", "shard")',  # HSDP
    ],
)
def test_the_cluster_page_shows(site: Path, shown: str) -> None:  # noqa: F811
    assert shown in _text(site / "guide" / "cluster.html")


def test_the_hsdp_table_shows_the_bytes_the_tests_measure(site: Path) -> None:  # noqa: F811
    shown = _text(site / "guide" / "cluster.html")
    for calls, nbytes in hsdp_prediction(nodes=2, ranks_per_node=2).collectives.values():
        assert re.search(rf"\b{calls}\s+{nbytes:,}\b", shown), (calls, nbytes)


def test_the_cluster_page_is_in_the_navigation(site: Path) -> None:  # noqa: F811
    assert 'href="guide/cluster.html"' in (site / "index.html").read_text()


def test_the_page_shows_the_slurm_script_as_committed(site: Path) -> None:  # noqa: F811
    script = (ROOT / "examples" / "slurm_fsdp2.sbatch").read_text()
    shown = _text(site / "guide" / "cluster.html")
    assert all(line in shown for line in script.splitlines() if line.strip())
