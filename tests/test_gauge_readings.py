"""A rank's gauge read as it is is written once: its row in the readings table (a ``Gauge``
tree: the recording rule's ``max by (rank) (family)``) and the family the page writes it
with. The daemon's history reads it from those two (``history.read_gauges``), as Prometheus
does, with no code of its own: a throwaway one added to a copy of the package in those two
places only is recorded by the rules and filled on the daemon's reports."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, edited_package

from exporter.heuristics.readings import RankReport
from exporter.serving.history import GAUGE_READINGS, read_gauges
from exporter.serving.ingest import RankState
from exporter.serving.training import DEPARTED


def _state() -> RankState:
    return RankState("r", "0", "a", 0.0, 1e9, steps=10, loader_workers=4,
                     collective_timeout_seconds=120.0, last_step_timestamp=1e9 - 30,
                     process_running=True, finished=False, failed=True)


def test_every_gauge_reading_is_its_familys_sample_on_the_report():
    assert {r.field for r, _ in GAUGE_READINGS} >= {
        "loader_workers", "collective_timeout", "process_running", "finished", "failed",
        "seconds_since_step"}
    rep = RankReport("", "n1", "r", "0")
    read_gauges(rep, _state(), now=1e9)
    assert (rep.loader_workers, rep.collective_timeout, rep.seconds_since_step) == \
        (4, 120.0, 30.0)
    assert rep.process_running is True and rep.failed is True and rep.finished is False


def test_a_departed_rank_reads_only_what_its_page_keeps():
    """As Prometheus sees a departed rank: its end, no collective timeout or loader."""
    rep = RankReport("", "n1", "r", "0")
    read_gauges(rep, _state(), now=1e9, families=DEPARTED)
    assert rep.failed is True and rep.seconds_since_step == 30.0
    assert rep.collective_timeout is None and rep.loader_workers is None


# (file under exporter/, the line it goes beside, the text): a family, a row, a field
EDITS = [
    ("serving/training.py", '    Family(STEP_HISTOGRAM, "histogram",',
     "    Family(\"gputrain_training_throwaway\", \"gauge\", \"Twice the steps.\",\n"
     "           read=lambda st: st.steps * 2.0),\n"),
    ("heuristics/readings.py", "    Reading(\"finished\", \"rank\",",
     "    Reading(\"throwaway\", \"rank\", \"run_rank:gputrain_training_throwaway:max\", None,\n"
     "            Gauge(\"gputrain_training_throwaway\", \"max\")),\n"),
    ("heuristics/readings.py", "    stopped: bool = False\n",
     "    throwaway: float | None = None\n"),
]


@pytest.mark.parametrize("where, anchor, text", EDITS)
def test_edits(where, anchor, text):
    """(The edits the next test makes: each anchor is in its file once.)"""
    assert (ROOT / "exporter" / where).read_text().count(anchor) == 1


def test_a_new_gauge_reading_takes_its_row_and_its_family_and_nothing_else(tmp_path):
    edited_package(tmp_path, EDITS)
    probe = """
from exporter.heuristics.readings import RankReport
from exporter.heuristics.rules import render
from exporter.serving.history import read_gauges
from exporter.serving.ingest import RankState
rules = render()
assert "record: run_rank:gputrain_training_throwaway:max" in rules, "no recording rule"
assert "max by (job, instance, run, rank) (gputrain_training_throwaway" in rules
rep = RankReport("", "n1", "r", "0")
read_gauges(rep, RankState("r", "0", "a", 0.0, 1e9, steps=21), now=1e9)
print(rep.throwaway)
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "42.0"
