"""The README's metric and flag tables are checked against the code that exports and parses
them: a family or flag added, renamed or removed without the README fails here."""

from __future__ import annotations

import re

from conftest import ROOT

from exporter.config import OPTIONS
from exporter.reading.collectors import COLLECTORS, GpuCollector, SelfCollector, host_collectors
from exporter.reading.collectors.training import TrainingCollector
from exporter.serving.ingest import IngestStore

README = (ROOT / "README.md").read_text()


def exported() -> dict[str, tuple[str, list[str]]]:
    """Every family any collector can export: name -> (type, labels)."""
    collectors = [GpuCollector(lambda: None), SelfCollector(lambda: None),
                  TrainingCollector(IngestStore(), lambda: None), *host_collectors(COLLECTORS)]
    out = {}
    for c in collectors:
        families = c.describe() if hasattr(c, "describe") else c.families()
        for f in families:
            name = f.name + "_total" if f.type == "counter" else f.name
            out[name] = (f.type, [])
    return out


def documented() -> dict[str, tuple[str, list[str]]]:
    """name -> (type, labels) from every README table whose header starts | name | type |."""
    out: dict[str, tuple[str, list[str]]] = {}
    header: list[str] | None = None
    for line in README.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[:2] == ["name", "type"]:
            header = cells
        elif header and cells[0].startswith("`gputrain_") and not cells[0].endswith("*`"):
            row = dict(zip(header, cells, strict=False))
            labels = re.sub(r"\([^)]*\)", "", row.get("labels", ""))
            out[cells[0].strip("`")] = (row["type"], [x.strip() for x in labels.split(",")
                                                       if x.strip()])
    return out


def test_every_exported_family_is_in_the_readme_with_its_type():
    code, readme = exported(), documented()
    assert sorted(set(code) - set(readme)) == [], "exported but not in the README's tables"
    assert sorted(set(readme) - set(code)) == [], "in the README but exported by no collector"
    for name, (kind, _) in code.items():
        assert readme[name][0] == kind, f"{name}: README says {readme[name][0]}, code {kind}"


def test_every_family_has_the_labels_the_readme_gives():
    code = {}
    for c in [GpuCollector(lambda: None), SelfCollector(lambda: None),
              TrainingCollector(IngestStore(), lambda: None)]:
        for f in c.describe():
            # an empty family keeps its label names on the side: read them from add_metric
            labels = list(getattr(f, "_labelnames", ()))
            code[f.name + ("_total" if f.type == "counter" else "")] = labels
    readme = documented()
    for name, labels in code.items():
        if labels:
            assert readme[name][1] == labels, f"{name}: README {readme[name][1]}, code {labels}"


def test_every_flag_is_in_the_readme():
    table = README[README.index("## Flags"):README.index("## Metrics")]
    listed = set(re.findall(r"`(--[a-z.-]+)", table))
    flags = {f"--{o.key}" for o in OPTIONS if not o.key.startswith("collector.")}
    assert sorted(flags - listed) == [], "flags missing from the README's table"
    assert sorted(listed - flags - {"--collector.", "--no-collector.", "--config.file"}) == []
    names = re.search(r"\| `--collector\.<name>` / `--no-collector\.<name>` \| [^|]* \| ([^|]*)\|",
                      table)
    assert names, "the collector flags' row is missing"
    assert set(re.findall(r"`(\w+)`", names.group(1))) == set(COLLECTORS)


def test_the_push_limits_in_the_readme_are_the_protocols():
    """The limits a client must respect, as exporter/protocol.py sets them."""
    from exporter import protocol

    section = README[README.index("### Push protocol"):]
    section = section[:section.index("\n## ")]
    for phrase in (f"at most {protocol.MAX_BUCKETS} histogram\nbuckets",
                   f"{protocol.MAX_PHASES} phases and {protocol.MAX_GPUS} GPUs",
                   f"at most {protocol.MAX_SERIES_PER_RANK} lines on the page",
                   f"at most {protocol.MAX_PHASES} names",
                   f"at most {protocol.MAX_GPUS} UUIDs",
                   f"phase names past the {protocol.MAX_PHASES - 1}th",
                   f"1-{protocol.MAX_NAME_LENGTH} characters",
                   f"at most {protocol.MAX_BODY_BYTES // 2**20} MiB"):
        assert phrase in section, phrase


def test_every_recording_rule_the_readme_names_is_shipped():
    from exporter.heuristics.promql import recording_rules
    from exporter.heuristics.rules import DEFAULTS

    records = set(recording_rules(DEFAULTS["selector"]))
    named = set(re.findall(r"`((?:run|run_rank|run_rank_gpu|run_rank_cause|run_rank_phase|gpu|"
                           r"instance):gputrain_\w+:\w+)", README))
    assert named and sorted(named - records) == []
