"""Replay a harness recording through the shipped rules: which alerts fire?

The recording becomes OpenMetrics with the scrapes' timestamps, ``promtool tsdb
create-blocks-from openmetrics`` backfills it into a TSDB, and a real Prometheus opened on that
TSDB evaluates every alert of ``alerts/gputrain.rules.yml``, with the recording rules it uses
written inline, at the end of the recording. An alert counts as firing when its condition holds
at every 5 s step of the last ``hold`` seconds: the ``for`` of the rules, scaled down to a
recording of a minute or two. The ratios divide two counters over the same window, so they are
right from the first scrapes.

    .venv/bin/python tests/gpu/replay.py tests/data/cpu-demo/*.prom.gz
    .venv/bin/python tests/gpu/replay.py --table DIR     # docs/gpu-proof.md's table of a run
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from exporter.heuristics.promql import inline  # noqa: E402
from gpu.harness import (  # noqa: E402
    agreement_markdown,
    free_port,
    markdown,
    read_recording,
)

JOB, INSTANCE = "gputrain", "gpu-node:19400"


def to_openmetrics(recording: Path | list, job: str = JOB, instance: str = INSTANCE) -> str:
    """Every sample of every scrape (of a recording, or the scrapes given), grouped by name
    (OpenMetrics wants a family's samples together), each an ``unknown`` family so the names
    stay exactly as scraped."""
    by_name: dict[str, list[str]] = {}
    scrapes = read_recording(recording) if isinstance(recording, Path) else recording
    for t, samples in scrapes:
        for (name, labels), value in samples.items():
            all_labels = {**dict(labels), "job": job, "instance": instance}
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(all_labels.items()))
            by_name.setdefault(name, []).append(f"{name}{{{text}}} {value!r} {t:.3f}")
    return openmetrics_text(by_name)


def openmetrics_text(by_name: dict[str, list[str]]) -> str:
    """Sample lines grouped by metric name (OpenMetrics wants a family's samples together) as
    a file for ``promtool tsdb create-blocks-from openmetrics``: each an ``unknown`` family,
    so the names stay exactly as given."""
    lines = []
    for name in sorted(by_name):
        lines.append(f"# TYPE {name} unknown")
        lines.extend(by_name[name])
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def inline_alerts(rules_text: str) -> list[dict]:
    """Each alert rule with the recording rules it uses written inline."""
    return inline_groups(yaml.safe_load(rules_text)["groups"])


def inline_groups(groups: list[dict]) -> list[dict]:
    """:func:`inline_alerts` of rule groups as :func:`exporter.heuristics.rules.groups` makes
    them."""
    records = {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}
    return [{**r, "inlined": inline(r["expr"], records)}
            for g in groups for r in g["rules"] if "alert" in r]


class Backfilled:
    """A real Prometheus over series backfilled from OpenMetrics text (no scraping, no
    rules): ``promtool tsdb create-blocks-from openmetrics``, then the server on that TSDB."""

    def __init__(self, openmetrics: str, workdir: Path) -> None:
        self.workdir = workdir
        om = workdir / "series.om"
        om.write_text(openmetrics)
        data = workdir / "data"
        out = subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(om),
                              str(data)], capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"backfill failed: {out.stdout}{out.stderr}")
        (workdir / "prometheus.yml").write_text("global: {}\n")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={data}", "--storage.tsdb.retention.time=100y",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while True:
            try:
                if requests.get(f"{self.url}/-/ready", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError("the backfilled Prometheus did not start: "
                                   + (workdir / "prometheus.log").read_text()[-2000:])
            time.sleep(0.2)

    def query(self, expr: str, at: float) -> list[dict]:
        r = requests.get(f"{self.url}/api/v1/query",
                         params={"query": expr, "time": f"{at:.3f}"}, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise ValueError(f"{expr}: {body.get('error')}")
        return body["data"]["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)
        self.log.close()


def training_span(scrapes: list, run: str, warmup: float) -> list:
    """The scrapes a verdict on run ``run`` may read: from ``warmup`` seconds after its first
    push to its last scrape before it said it finished (the daemon still shows the scenario
    before, finished). A recording holds the
    trainer's start-up (torch's import, CUDA's context: the GPU idle) and its goodbye (every
    rule then stands down, as it must for a run that ended), and its windows are shorter than
    the rules' 5 minutes, so either would be in every rate the rules read. All the scrapes
    where fewer than two would be left."""
    def ours(labels: tuple) -> bool:
        return dict(labels).get("run") == run

    pushed = [t for t, samples in scrapes
              if any(n == "gputrain_training_steps_total" and ours(labels)
                     for n, labels in samples)]
    if not pushed:
        return scrapes
    ended = next((t for t, samples in scrapes
                  if any(n == "gputrain_training_finished" and ours(labels) and v > 0
                         for (n, labels), v in samples.items())), None)
    kept = [(t, samples) for t, samples in scrapes
            if t >= pushed[0] + warmup and (ended is None or t < ended)]
    return kept if len(kept) >= 2 else scrapes


class Replay(Backfilled):
    """A harness recording, backfilled: the span of its training (``training_span``)."""

    def __init__(self, recording: Path, workdir: Path, warmup: float = 10.0,
                 whole: bool = False) -> None:
        """``whole``: every scrape, as the daemon that was scraped saw them (to set beside its
        own status view), not only the run's training span."""
        self.recording = recording
        scrapes = read_recording(recording)
        if len(scrapes) < 2:
            raise ValueError(f"{recording}: fewer than two scrapes")
        if not whole:
            scrapes = training_span(scrapes, recording.name.removesuffix(".prom.gz"), warmup)
        self.start_time = scrapes[0][0]
        self.end_time = scrapes[-1][0]
        super().__init__(to_openmetrics(scrapes), workdir)

    def judged_times(self, hold: float = 30.0, step: float = 5.0) -> list[float]:
        """The times :meth:`firing` evaluates at: every ``step`` s over the last ``hold`` s."""
        at_end = self.end_time - 2  # the last scrape can be partial
        hold = min(hold, (at_end - self.start_time) / 3)  # a short recording: its last third
        return [at_end - hold + i * step for i in range(int(hold / step) + 1)]

    def firing(self, rules_text: str, hold: float = 30.0, step: float = 5.0) -> dict[str, list]:
        """Alert name -> the label sets for which its condition held over the last ``hold``
        seconds of the recording."""
        times = self.judged_times(hold, step)
        out: dict[str, list] = {}
        for alert in inline_alerts(rules_text):
            held = None
            for t in times:
                now = {tuple(sorted(r["metric"].items())) for r in self.query(alert["inlined"], t)}
                held = now if held is None else held & now
                if not held:
                    break
            if held:
                out.setdefault(alert["alert"], []).extend(dict(x) for x in held)
        return out



def diagnose(url: str, run: str, at: float) -> list[dict]:
    """``gputrain-exporter diagnose --json`` of run ``run`` at ``at`` (unix seconds) against
    the Prometheus at ``url``: its rank reports."""
    out = subprocess.run([sys.executable, "-m", "exporter", "diagnose", "--prometheus", url,
                          "--json", "--time", str(at), "--run", run], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    if out.returncode not in (0, 1, 3):
        raise RuntimeError(f"diagnose failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)["ranks"]


def status_agreement(recording: Path, status: dict) -> tuple[list, list]:
    """What the daemon's status view said of a scenario's run (the harness's
    ``<scenario>.status.json``) and what ``diagnose`` says of the whole recording at the same
    moment: each as sorted (rank, verdict, further findings)."""
    run = recording.name.removesuffix(".prom.gz")
    with tempfile.TemporaryDirectory() as tmp:
        r = Replay(recording, Path(tmp), whole=True)
        try:
            reports = diagnose(r.url, run, status["time"])
        finally:
            r.stop()
    page = sorted((x["rank"], x["verdict"], tuple(sorted(a["verdict"] for a in x["also"])))
                  for x in status["run"]["ranks"])
    told = sorted((x["rank"], x["verdict"],
                   tuple(sorted(f for f in x["findings"] if f != x["verdict"])))
                  for x in reports)
    return page, told


def explain(recording: Path, series: list[str], hold: float = 30.0,
            warmup: float = 10.0) -> str:
    """Each recorded series of ``series`` (the shipped rules' expressions, inlined) at the
    times :func:`replay` judges, and how many scrapes that span holds: why a verdict held or
    did not, in words for a failing test."""
    groups = yaml.safe_load((ROOT / "alerts" / "gputrain.rules.yml").read_text())["groups"]
    records = {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}
    with tempfile.TemporaryDirectory() as tmp:
        r = Replay(recording, Path(tmp), warmup)
        try:
            times = r.judged_times(hold)
            lines = [f"judged at {len(times)} times over {times[-1] - times[0]:.0f} s of a "
                     f"{r.end_time - r.start_time:.0f} s span"]
            for name in series:
                values = [[x["value"][1] for x in r.query(inline(name, records), t)]
                          for t in times]
                lines.append(f"{name}: {values}")
            return "; ".join(lines)
        finally:
            r.stop()


def replay(recording: Path, rules_text: str | None = None, hold: float = 30.0,
           warmup: float = 10.0) -> dict:
    rules_text = rules_text or (ROOT / "alerts" / "gputrain.rules.yml").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        r = Replay(recording, Path(tmp), warmup)
        try:
            return r.firing(rules_text, hold)
        finally:
            r.stop()


def table(directory: Path) -> str:
    """docs/gpu-proof.md's table for a harness run: measured figures, alerts fired, the
    published figures beside them."""
    import json

    results = json.loads((directory / "summary.json").read_text())["scenarios"]
    fired = {r["scenario"]: sorted(a.removeprefix("GpuTrain") for a in
                                   replay(directory / f"{r['scenario']}.prom.gz"))
             for r in results}
    return markdown(results, fired) + "\n" + agreement_markdown(results)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Replay harness recordings through the shipped "
                                            "rules and say which alerts fire.")
    p.add_argument("recordings", nargs="*", type=Path, help="*.prom.gz files of a harness run")
    p.add_argument("--table", type=Path, metavar="DIR",
                   help="print the Markdown table of a harness run's directory instead")
    ns = p.parse_args(argv)
    if ns.table:
        print(table(ns.table), end="")
        return 0
    if not ns.recordings:
        p.error("give recordings (*.prom.gz) or --table DIR")
    for path in ns.recordings:
        fired = replay(path)
        print(f"{path.name}: {', '.join(sorted(fired)) or 'no alerts'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
