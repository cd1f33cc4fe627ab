"""A run younger than the rate window is judged on its own time, alike on every surface.

A job starts on a GPU that idled (or served another run) for the minutes before it. The rules
read a rank's GPU over the rate window (5 m): before this, diagnose called a job that kept its
GPU 95 % busy since it came "host-overhead" (GPU busy 41 %) for its first five minutes, while
the page said "gpu-bound". Now a rank younger than the rate window (its wall seconds) is read
as a young regime is, on every surface: once it is a regime window (1 m) old, its rates and its
GPUs' readings over the last minute alone. (In its first minute the last minute would still
hold its GPU's time before it: the page reads it since its first push, test_status.py, which
the rules cannot; diagnose reads the whole window until then.)

Each scenario is lived by the daemon's own parts (the fake driver under the real NVML binding,
the ingest, the history, the /metrics page) and the page is scraped every 15 s into the PromQL
evaluator, which tests/test_agreement.py holds to a real Prometheus on every query diagnose
sends: diagnose's verdict from those scrapes and the daemon's from its history must match,
and the rank's GPU readings too.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from fake_nvml import FakeGpu
from prometheus_client.parser import text_string_to_metric_families
from test_status import H100, Node, T, push

from exporter.heuristics import diagnose
from exporter.heuristics.evaluator import Engine, Store, labels_of
from exporter.heuristics.readings import REGIME_GPU, RankReport
from exporter.heuristics.rules import identity, settings
from exporter.heuristics.verdict import judge, visibility
from exporter.serving.exposition import Exposition

SCRAPE_SECONDS = 15  # Prometheus' scrape interval here
INSTANCE = "n1:19400"


@dataclass
class Lived:
    page: RankReport  # the daemon's verdict (its history, the status view's code)
    diagnose: RankReport  # diagnose's, from the scrapes of the daemon's page


def live(clock, *, before: int, after: int, starts: int, ends: int, wait: float = 0.0,
         dip: tuple[int, int] | None = None) -> Lived:
    """A node whose GPU runs at ``before`` % busy, then at ``after`` % from the second
    ``starts`` on, when a rank starts pushing (0.1 s steps, ``wait`` of each waiting for
    data), at 20 % over the seconds ``dip`` [from, to); judged at second ``ends`` by the
    daemon and by diagnose."""
    gpu = FakeGpu("GPU-a", name=H100, util_rate=before, memory_used=1024**3)
    node = Node(clock, [gpu], window=300.0)
    page = Exposition(node.sampler, node.store, views=node.views,
                      regimes=node.history.regime_starts)
    scraped = Store(retention_ms=10 ** 12)
    state = {"steps": 0, "step_seconds": 0.0, "data_wait_seconds": 0.0, "samples": 0.0,
             "elapsed_seconds": 0.0}
    for second in range(ends + 1):
        if second >= starts:
            gpu.util_rate, gpu.memory_used = after, 60 * 1024**3  # the job's model, batches
            if dip is not None and dip[0] <= second < dip[1]:
                gpu.util_rate = 20
            state["steps"] += 10
            state["step_seconds"] += 1.0
            state["data_wait_seconds"] += wait
            state["samples"] += 320
            state["elapsed_seconds"] += 1.0
            push(node.store, run_id="a", gpus=["0"], **state)
        node.sampler.run_once()
        view = node.views.update(node.sampler.snapshot, node.store.states())
        node.history.observe(view)
        if second % SCRAPE_SECONDS == 0:
            scrape(scraped, page.render()[0].decode(), clock())
        if second < ends:
            clock.advance(1.0)
    cfg = settings()
    reports, _ = diagnose.collect(Engine(scraped, int(clock() * 1000)), cfg["selector"], "5m",
                                  None, identity(cfg))
    (theirs,) = judge(visibility(reports), T)
    (ours,) = judge(visibility(node.history.reports()), T)
    return Lived(ours, theirs)


def scrape(store: Store, text: str, t: float) -> None:
    """One scrape of the page, as Prometheus stores it (job and instance added, ``up``)."""
    job = {"job": "gputrain", "instance": INSTANCE}
    samples = [(labels_of({**s.labels, "__name__": s.name, **job}), float(s.value))
               for family in text_string_to_metric_families(text) for s in family.samples]
    samples.append((labels_of({"__name__": "up", **job}), 1.0))
    store.append_all(int(t * 1000), samples)


def agree(lived: Lived) -> None:
    """Both surfaces say the same of the rank: its verdict, its findings and its GPU's
    readings."""
    page, diag = lived.page, lived.diagnose
    assert (page.status, page.verdict, set(page.findings())) == \
        (diag.status, diag.verdict, set(diag.findings())), \
        f"the page says {page.verdict} ({page.reason}), diagnose {diag.verdict} ({diag.reason})"
    for name in REGIME_GPU:
        ours, theirs = getattr(page.gpus[0], name), getattr(diag.gpus[0], name)
        assert (ours is None) == (theirs is None), name
        if ours is not None:
            assert ours == pytest.approx(theirs, abs=0.02), name
    assert page.data_wait_ratio == pytest.approx(diag.data_wait_ratio, abs=0.01)


def test_a_job_that_keeps_its_fresh_gpu_busy_is_gpu_bound_from_its_second_minute(clock):
    # the GPU idled 200 s before the job; 130 s in, the 5 m window would read 41 % busy
    lived = live(clock, before=0, after=95, starts=200, ends=330)
    agree(lived)
    assert lived.diagnose.verdict == "gpu-bound", lived.diagnose.reason
    assert lived.diagnose.gpus[0].busy == pytest.approx(0.95, abs=0.02)


def test_a_job_after_a_busy_one_is_judged_on_its_own_idle_gpu(clock):
    # another run kept the GPU 90 % busy; this one waits for data 60 % of each step, its GPU
    # 30 % busy: the 5 m window would read 64 %
    lived = live(clock, before=90, after=30, starts=200, ends=330, wait=0.6)
    agree(lived)
    assert lived.diagnose.verdict == "input-bound", lived.diagnose.reason
    assert lived.diagnose.gpus[0].busy == pytest.approx(0.30, abs=0.02)


def test_near_miss_a_rank_older_than_the_window_keeps_the_whole_window(clock):
    """A rank 6 minutes old is read over the 5 minutes: a minute of its GPU at 20 %, 3 minutes
    ago, still weighs in (the last minute alone would read 95 %), alike on both surfaces."""
    lived = live(clock, before=0, after=95, starts=30, ends=400, dip=(220, 280))
    agree(lived)
    assert lived.diagnose.gpus[0].busy == pytest.approx((4 * 0.95 + 0.2) / 5, abs=0.02)
    assert lived.page.gpus[0].busy == pytest.approx(lived.diagnose.gpus[0].busy, abs=0.02)


def test_a_young_rank_is_read_over_its_last_minute_not_its_first(clock):
    """Four minutes old, with a dip to 20 % in its second minute: the last minute alone
    (95 %) on both surfaces, the dip left out as the idle time before it is."""
    lived = live(clock, before=0, after=95, starts=200, ends=440, dip=(280, 340))
    agree(lived)
    assert lived.diagnose.gpus[0].busy == pytest.approx(0.95, abs=0.02)
