"""The README and the pages of docs/ checked against the code and the repository: the metric
and flag tables, the push protocol's limits, the status document, every link, every
`gputrain-exporter` command, the quick start's list of what it installs, and that nothing is
cited that a clone does not hold. A family, flag or limit added, renamed or removed without
its page fails here."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from importlib import metadata

import pytest
import requests
from conftest import ENV_BIN, ROOT, synthetic_client, wait_until

from exporter.config import OPTIONS
from exporter.reading.collectors import COLLECTORS, GpuCollector, SelfCollector, host_collectors
from exporter.serving.exposition import page_families
from exporter.serving.ingest import IngestStore
from exporter.serving.training import TrainingCollector

README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
PAGES = {p.name: p.read_text() for p in sorted(DOCS.glob("*.md"))}
ALL = {"README.md": README, **{f"docs/{n}": t for n, t in PAGES.items()}}


def page(name: str) -> str:
    return PAGES[name]


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole heading line) up to the next heading of its level
    or higher."""
    level = heading.split(" ", 1)[0]
    text = "\n" + text
    start = text.index(f"\n{heading}\n") + 1
    rest = text[start + len(heading) + 1:]
    fenced = [m.span() for m in re.finditer(r"^```.*?^```", rest, re.M | re.S)]
    ends = [m.start() for m in re.finditer(r"^(#+) ", rest, re.M)
            if len(m.group(1)) <= len(level) and not any(a < m.start() < b for a, b in fenced)]
    return heading + "\n" + (rest[:ends[0]] if ends else rest)


def code_blocks(text: str, *languages: str) -> list[str]:
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
            if m.group(1) in languages]


def shell_lines(block: str) -> list[str]:
    """The commands of a shell block: continuations joined, comments and prompts dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*", "", line).strip()
        if line:
            out.append(line.removeprefix("$ "))
    return out


def without_generated(text: str) -> str:
    return re.sub(r"<!-- BEGIN generated:.*?<!-- END generated: [^>]*-->", "", text, flags=re.S)


# --- the metric tables (docs/metrics.md) --------------------------------------------------

def exported() -> dict[str, tuple[str, list[str]]]:
    """Every family any collector can export: name -> (type, labels)."""
    collectors = [GpuCollector(lambda: None), SelfCollector(lambda: None),
                  TrainingCollector(IngestStore(), lambda: None), *host_collectors(COLLECTORS)]
    out = {}
    for families in [c.describe() if hasattr(c, "describe") else c.families()
                     for c in collectors] + [page_families()]:
        for f in families:
            name = f.name + "_total" if f.type == "counter" else f.name
            out[name] = (f.type, [])
    return out


def metric_rows(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (type, labels) from every table of ``text`` whose header starts | name | type |."""
    out: dict[str, tuple[str, list[str]]] = {}
    header: list[str] | None = None
    for line in text.splitlines():
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


def test_every_exported_family_is_in_the_metrics_page_with_its_type():
    code, documented = exported(), metric_rows(page("metrics.md"))
    assert sorted(set(code) - set(documented)) == [], "exported but not in docs/metrics.md"
    assert sorted(set(documented) - set(code)) == [], "in docs/metrics.md but exported by none"
    for name, (kind, _) in code.items():
        assert documented[name][0] == kind, f"{name}: the page says {documented[name][0]}, " \
                                            f"the code {kind}"


def test_every_family_has_the_labels_the_metrics_page_gives():
    code = {}
    for c in [GpuCollector(lambda: None), SelfCollector(lambda: None),
              TrainingCollector(IngestStore(), lambda: None)]:
        for f in c.describe():
            # an empty family keeps its label names on the side: read them from add_metric
            labels = list(getattr(f, "_labelnames", ()))
            code[f.name + ("_total" if f.type == "counter" else "")] = labels
    documented = metric_rows(page("metrics.md"))
    for name, labels in code.items():
        if labels:
            assert documented[name][1] == labels, f"{name}: page {documented[name][1]}, " \
                                                  f"code {labels}"


def test_each_table_and_schema_is_written_in_one_place():
    """The metric tables, the flags table, the push schema and the generated tables each live
    on one page; the others link to it."""
    where = {
        "metric table": lambda t: bool(metric_rows(t)),
        "flags table": lambda t: "| `--web.listen-address` |" in t,
        "push schema": lambda t: '"run_id": "' in t,
        "alert table": lambda t: "<!-- BEGIN generated: alert table" in t,
        "threshold table": lambda t: "<!-- BEGIN generated: threshold table" in t,
    }
    found = {what: [name for name, text in ALL.items() if holds(text)]
             for what, holds in where.items()}
    assert found == {"metric table": ["docs/metrics.md"], "flags table": ["docs/flags.md"],
                     "push schema": ["docs/push-protocol.md"],
                     "alert table": ["docs/alerts.md"], "threshold table": ["docs/alerts.md"]}


# --- flags (docs/flags.md) ----------------------------------------------------------------

def test_every_flag_is_in_the_flags_page():
    table = section(page("flags.md"), "# Flags and configuration")
    table = table[:table.index("## The config file")]
    listed = set(re.findall(r"`(--[a-z.-]+)", table))
    flags = {f"--{o.key}" for o in OPTIONS if not o.key.startswith("collector.")}
    assert sorted(flags - listed) == [], "flags missing from docs/flags.md's table"
    assert sorted(listed - flags - {"--collector.", "--no-collector.", "--config.file"}) == []
    names = re.search(r"\| `--collector\.<name>` / `--no-collector\.<name>` \| [^|]* \| ([^|]*)\|",
                      table)
    assert names, "the collector flags' row is missing"
    assert set(re.findall(r"`(\w+)`", names.group(1))) == set(COLLECTORS)


def test_every_default_written_as_a_value_is_the_flags():
    """A default the table writes as a value (`1s`, `:19400`) is the one the daemon takes;
    a default in words (moving, shipped table) is not checked."""
    table = page("flags.md")[:page("flags.md").index("## The config file")]
    shown = {f"--{o.key}": o.shown_default() for o in OPTIONS}
    checked = 0
    for flag, default in re.findall(r"^\| `(--[a-z.-]+)` \| `([^`]+)` \|", table, re.M):
        assert default == shown[flag], f"{flag}: the page says {default}, the daemon {shown[flag]}"
        checked += 1
    assert checked >= 10


# --- the push protocol (docs/push-protocol.md) and profiles --------------------------------

def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_the_push_limits_on_the_page_are_the_protocols():
    """The limits a client must respect, as exporter/protocol.py sets them."""
    from exporter import protocol
    from exporter.serving import training

    text = flat(page("push-protocol.md"))
    for phrase in (f"at most {protocol.MAX_BUCKETS} histogram buckets",
                   f"{protocol.MAX_PHASES} phases and {protocol.MAX_GPUS} GPUs",
                   f"at most {training.MAX_SERIES_PER_RANK} lines on the page",
                   f"at most {protocol.MAX_PHASES} names",
                   f"at most {protocol.MAX_GPUS} UUIDs",
                   f"phase names past the {protocol.MAX_PHASES - 1}th",
                   f"1-{protocol.MAX_NAME_LENGTH} characters",
                   f"at most {protocol.MAX_BODY_BYTES // 2**20} MiB",
                   f"at most {protocol.MAX_PROFILE_TOP_OPS} of `name`",
                   f"POST {protocol.PUSH_PATH}"):
        assert phrase in text, phrase
    profiles = flat(page("profiles.md"))
    for phrase in (f"`--steps` to {protocol.DEFAULT_PROFILE_STEPS} "
                   f"(at most {protocol.MAX_PROFILE_STEPS};",
                   f"steps outside 1-{protocol.MAX_PROFILE_STEPS}",
                   f"`POST {protocol.PROFILE_PATH}`", f"`POST {protocol.ALERTS_PATH}`"):
        assert phrase in profiles, phrase
    from exporter.client.profiling import DEFAULT_TRACE_BUDGET_MB
    from exporter.serving import profiles as board

    for phrase in (f"last {board.KEEP} finished profiles",
                   f"within {board.QUEUE_TIMEOUT:.0f} s",
                   f"expires if no step ends in {board.START_TIMEOUT / 60:.0f} min",
                   f"expires without a result in {board.RUN_TIMEOUT / 60:.0f} min",
                   f"`GPUTRAIN_TRACE_BUDGET_MB` ({DEFAULT_TRACE_BUDGET_MB} MiB"):
        assert phrase in profiles, phrase
    parts = section(page("profiles.md"), "## Where a step's time went")
    rows = re.findall(r"^\| ([a-z ]+) \|", parts, re.M)
    assert [r.replace(" ", "_") for r in rows if r != "part"] == sorted(
        protocol.STEP_PARTS, key=lambda p: ["data_loading", "backward", "optimizer", "forward",
                                            "other", "idle"].index(p))


# --- the rules ----------------------------------------------------------------------------

def test_every_recording_rule_the_docs_name_is_shipped():
    from exporter.heuristics.rules import groups

    records = {r["record"] for g in groups() for r in g["rules"] if "record" in r}
    named = set()
    for text in ALL.values():
        named |= set(re.findall(r"`((?:run|run_rank|run_rank_gpu|run_rank_cause|run_rank_phase|"
                                r"gpu|instance):gputrain_\w+:\w+)", text))
    assert named and sorted(named - records) == []


def test_the_decision_order_on_the_diagnose_page_is_the_codes():
    from exporter.heuristics.verdict import ORDER

    text = page("diagnose.md")
    listed = text.split("<!-- BEGIN generated: decision order")[1].split("<!-- END")[0]
    assert tuple(re.findall(r"`([a-z-]+)`", listed)) == ORDER


# --- the status document (docs/status-page.md) ---------------------------------------------

def shape(value, path: str = "") -> set[str]:
    """Every key path of a JSON document (the first element of each list stands for all;
    maps of names, such as phases, are left open)."""
    out = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(f"{path}.{k}")
            if k not in ("phases", "badput"):
                out |= shape(v, f"{path}.{k}")
    elif isinstance(value, list) and value and isinstance(value[0], dict):
        out |= shape(value[0], path + "[]")
    return out


def test_the_status_example_has_the_documents_fields(daemon_factory):
    """The abridged answer on the page names exactly the fields a daemon with a run sends."""
    (example,) = code_blocks(page("status-page.md"), "json")
    documented = json.loads(example)
    # a memory fault on its last GPU, so the document has a fault to show as the page does
    daemon = daemon_factory("--gpu.backend=demo", "--demo.gpus=2", "--demo.memory-fault")
    client = synthetic_client("starved", daemon.ingest_url, "--data-wait-ms", "30",
                              "--compute-ms", "10")
    try:
        doc = wait_until(lambda: (d := requests.get(daemon.url + "/api/v1/status",
                                                    timeout=10).json())["runs"]
                         and d["runs"][0]["verdicts"] and d["gpus"][0]["ranks"]
                         and d["faults"] and d,
                         timeout=60, what="a judged run and a fault in /api/v1/status")
    finally:
        client.kill()
        client.wait()
    # a window's ratio that cannot be measured here (network use of a NIC of unknown speed)
    # is left out of the document
    missing = {k for k in shape(documented) - shape(doc) if ".window." not in k}
    assert sorted(missing) == [], "in docs/status-page.md's example, not in the document"
    assert sorted(shape(doc) - shape(documented)) == [], \
        "in the daemon's document, not in docs/status-page.md's example"


# --- links and references -----------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", text, flags=re.S),
                                        re.M)}


def links() -> list[tuple[str, str]]:
    out = []
    for name, text in ALL.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"[a-z]+:", target):
                out.append((name, target))
    return out


@pytest.mark.parametrize(("source", "target"), links())
def test_every_link_in_the_docs_leads_somewhere(source, target):
    path, _, anchor = target.partition("#")
    file = (ROOT / source).parent / path if path else ROOT / source
    assert file.exists(), f"{source}: {target} does not exist"
    if anchor:
        assert anchor in anchors(file.read_text()), f"{source}: no heading #{anchor} in {path}"


def test_every_page_is_on_both_maps():
    index = page("README.md")
    for name in PAGES:
        if name != "README.md":
            assert f"](docs/{name})" in README, f"README.md's map lacks docs/{name}"
            assert f"]({name})" in index, f"docs/README.md lacks {name}"


def test_nothing_is_cited_that_a_clone_does_not_hold():
    """No file, issue or document of the project's own history; the generated tables are
    the catalogue's text."""
    for name, text in ALL.items():
        text = without_generated(text)
        for pattern in (r"DESIGN\.md", r"HEURISTICS\.md", r"\bissues? \d+",
                        r"\bseeds?\b(?!\.test\.yml)"):
            assert not re.search(pattern, text, re.I), f"{name} cites {pattern}"
        for path in re.findall(r"`((?:alerts|bench|deploy|docs|examples|exporter|grafana|"
                               r"scripts|tests)/[\w./-]*)`", text):
            if "<" not in path and not path.startswith("tests/data/gpu"):
                assert (ROOT / path).exists(), f"{name} names {path}, which is not in the clone"


def test_the_front_page_stays_a_front_page():
    assert len(README.splitlines()) <= 300


def test_the_status_pages_pointer_to_the_readme_is_true():
    """The page's empty state sends the reader to a README section: it exists, and says how to
    add the client to a loop."""
    js = (ROOT / "exporter" / "serving" / "static" / "status.js").read_text()
    for title in re.findall(r'README, \\"([^"\\]+)\\"', js):
        text = section(README, f"## {title}")
        assert "TrainingMonitor" in text and "](docs/client.md)" in text


# --- the quick start ----------------------------------------------------------------------

def quick_start() -> list[str]:
    (block,) = code_blocks(section(README, "## Quick start"), "sh")
    return block.split("\n\n")


def comment(step: str) -> str:
    return flat(" ".join(re.findall(r"^#\s*(.*)$", step, re.M)))


def test_the_quick_start_is_two_commands():
    assert [shell_lines(step) for step in quick_start()] == [
        ["scripts/install.sh && .venv/bin/gputrain-exporter"], ["scripts/test.sh"]]


def requirement_names(lines, extra: str | None = None) -> list[str]:
    """The names of requirement lines (of one extra, or of none)."""
    out = []
    for line in lines:
        line = line.strip()
        if line and not line.startswith("#"):
            marker = re.search(r'extra == "(\w+)"', line)
            if (marker.group(1) if marker else None) == extra:
                out.append(re.split(r"[<>=\[; ]", line)[0])
    return out


def test_the_quick_start_names_everything_it_installs():
    requires = metadata.requires("gputrain-exporter")
    install, test = (comment(step) for step in quick_start())
    extra = re.search(r'if \[ \$# -eq 0 \]; then set -- "\.\[(\w+)\]"',
                      (ROOT / "scripts" / "install.sh").read_text()).group(1)
    for name in [*requirement_names(requires), *requirement_names(requires, extra),
                 "python3-venv"]:
        assert name in install, f"step 1's comment does not name {name}"
    script = (ROOT / "scripts" / "test.sh").read_text()
    debian = re.findall(r"missing\+=\(([\w-]+)\)", script)
    assert len(debian) >= 5
    extras = re.search(r"install\.sh (?:--[\w-]+ )*-e '\.\[([\w,]+)\]'", script).group(1).split(",")
    frameworks = requirement_names((ROOT / "tests" / "frameworks.txt").read_text().splitlines())
    named = [*debian, *frameworks]
    for e in extras:
        if e != extra:  # step 1 installed that one
            named += [f"[{e}] extra", *requirement_names(requires, e)]
    for name in named:
        assert name in test, f"step 2's comment does not name {name}"


# --- commands -----------------------------------------------------------------------------

def exporter_commands() -> list[tuple[str, str]]:
    """(page, command) for every `gputrain-exporter` command in a shell or console block,
    and every inline one written as a command to run (`.venv/bin/gputrain-exporter ...`)."""
    out = []
    for name, text in ALL.items():
        for block in code_blocks(text, "sh", "console"):
            for line in shell_lines(block):
                if re.match(r"(\.venv/bin/)?gputrain-exporter\b", line):
                    out.append((name, line))
        prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        out += [(name, c) for c in re.findall(r"`(\.venv/bin/gputrain-exporter[^`]*)`", prose)]
    return out


@pytest.mark.parametrize(("source", "command"), exporter_commands())
def test_every_gputrain_exporter_command_in_the_docs_parses(source, command):
    """Its subcommand and flags are the command's own (optional parts in [brackets] and
    redirections left out)."""
    from exporter.cli.main import SUBCOMMANDS, build_parser
    from exporter.config import ConfigError, resolve

    assert command.startswith(".venv/bin/gputrain-exporter"), \
        f"{source}: write the command as the quick start installs it: {command}"
    command = re.sub(r"\s\[[^\]]*\]", "", command).split(" > ")[0]
    args = shlex.split(command)[1:]
    if not args or args[0] not in SUBCOMMANDS:
        args.insert(0, "serve")
    try:
        ns = build_parser().parse_args(args)
        if ns.command == "serve" and not getattr(ns, "config.file", None):  # the reader's file
            resolve(ns)
    except SystemExit as exc:
        if exc.code != 0 or "--help" not in args:  # --help exits 0 once it has printed
            pytest.fail(f"{source}: {command}: exit {exc.code}")
    except ConfigError as exc:
        pytest.fail(f"{source}: {command}: {exc}")


def test_the_thresholds_file_commands_run_as_written(tmp_path):
    """docs/alerts.md's own-thresholds commands, in an empty folder: a thresholds file, the
    rules and the dashboards made from it (diagnose, which needs a Prometheus, is parsed
    above)."""
    (block,) = code_blocks(section(page("alerts.md"), "## Your own thresholds"), "sh")
    ran = 0
    for command in shell_lines(block):
        if " diagnose " in command:
            continue
        out = subprocess.run(command.replace(".venv/bin/", f"{ENV_BIN}/"), shell=True,
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{command}: {out.stderr}"
        ran += 1
    assert ran == 3
    assert "input_bound: 0.05" in (tmp_path / "my-thresholds.yml").read_text()
    assert "GpuTrainInputBound" in (tmp_path / "gputrain.rules.yml").read_text()
    assert sorted(p.name for p in (tmp_path / "dashboards").iterdir()) == [
        "node.json", "overview.json", "run.json"]


def test_the_docs_run_the_project_from_the_quick_starts_environment():
    """No `python3` that is not the venv's: a stock python3 lacks the dependencies."""
    for name, text in ALL.items():
        for block in code_blocks(text, "sh", "console"):
            for line in shell_lines(block):
                assert not re.match(r"(PYTHONPATH=\S+ )?python3?\b(?! -m venv)", line), \
                    f"{name}: {line}"
        assert "python3 -m exporter" not in text, name


def test_the_status_pages_timings_are_the_codes():
    from exporter.serving import history, status

    js = (ROOT / "exporter" / "serving" / "static" / "status.js").read_text()
    refresh = int(re.search(r"REFRESH_MS = (\d+)", js).group(1)) / 1000
    text = flat(page("status-page.md"))
    for phrase in (f"It redraws every {refresh:g} s",
                   f"once {status.STALE_PUSH_SECONDS:.0f} s pass without a push",
                   f"rising over the last {history.LEAK_MIN_SECONDS / 60:.0f} minutes and the "
                   f"{history.LEAK_MIN_SECONDS / 60:.0f} before them",
                   f"asked in the last {status.VIEWER_SECONDS:.0f} s",
                   f"a point every {history.POINT_SECONDS:.0f} s"):
        assert phrase in text, phrase
