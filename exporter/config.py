"""Settings from command-line flags and an optional YAML file.

Every setting has one dotted name, used both as the flag (``--sampler.interval``) and as the
YAML key (``sampler.interval: 1s``, or nested: ``sampler: {interval: 1s}``). Flags override
the file, the file overrides the defaults. A bad file is an error that names the key.
"""

from __future__ import annotations

import argparse
import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from exporter.protocol import DEFAULT_INGEST_PORT, DEFAULT_METRICS_PORT
from exporter.reading.collectors import COLLECTORS
from exporter.reading.collectors.disk import DEFAULT_DISK_EXCLUDE
from exporter.reading.collectors.network import DEFAULT_NETDEV_EXCLUDE
from exporter.reading.peak_flops import parse_peak_overrides


class ConfigError(ValueError):
    """A setting has a value that cannot be used; the message names it."""


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any) -> float:
    """'500ms', '1s', '10m', '1h' or a plain number of seconds -> seconds (> 0)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as 1s or 10m, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ValueError(f"expected a duration such as 1s or 10m, got {value!r}")
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds <= 0:
        raise ValueError(f"a duration must be positive, got {value!r}")
    return seconds


def parse_interval(value: Any) -> float:
    """A duration as :func:`parse_duration` reads it, or 0 ('0s', '0'): no limit."""
    if not isinstance(value, bool) and str(value).strip() in ("0", "0s", "0ms", "0m", "0h"):
        return 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0.0
    return parse_duration(value)


def parse_listen_address(value: str) -> tuple[str, int]:
    """'host:port', ':port' or '[v6]:port' -> (host, port); host '' means every address."""
    text = str(value).strip()
    m = re.match(r"^(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:\[\]]*)):(?P<port>\d{1,5})$", text)
    if not m or not 0 <= int(m.group("port")) <= 65535:
        raise ValueError(f"expected host:port or :port, got {value!r}")
    return (m.group("v6") or m.group("host") or "", int(m.group("port")))


def _listen(value: Any) -> str:
    parse_listen_address(value)
    return str(value)


def _positive_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected a positive integer, got {value!r}")
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a positive integer, got {value!r}") from None
    if n <= 0 or (isinstance(value, float) and value != n):
        raise ValueError(f"expected a positive integer, got {value!r}")
    return n


def _status_window(value: Any) -> float:
    seconds = parse_duration(value)
    if not 30.0 <= seconds <= 3600.0:
        raise ValueError(f"expected a window between 30s and 1h, got {value!r}")
    return seconds


def _fraction(value: Any) -> float | None:
    if value is None or (isinstance(value, str) and value.lower() in ("", "auto", "moving")):
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a fraction between 0 and 1, got {value!r}") from None
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"expected a fraction between 0 and 1, got {value!r}")
    return f


def _choice(*options: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).lower()
        if text not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {value!r}")
        return text
    return parse


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _regex(value: Any) -> str:
    text = _text(value)
    try:
        re.compile(text)
    except re.error as exc:
        raise ValueError(f"not a valid regular expression: {exc}") from None
    return text


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


SPEED_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_link_speeds(value: Any) -> dict[str, float]:
    """'25Gbit' (every interface) or 'eth0=25Gbit,ib0=100Gbit' -> bytes/s by interface ('*'
    for every interface)."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in _text(value).split(","))):
        nic, _, speed = part.rpartition("=")
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(bit|b)(?:/s|ps)?", speed.strip())
        if not m:
            raise ValueError(f"{part!r}: expected a speed like 10Gbit or eth0=25Gbit")
        out[nic.strip() or "*"] = float(m[1]) * SPEED_UNITS[m[2].lower()] / 8
    return out


def format_duration(seconds: float) -> str:
    """1.0 -> '1s', 600.0 -> '10m', 0.5 -> '500ms', 0 -> '0s': durations as the docs write
    them."""
    if seconds == 0:
        return "0s"
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds * 1000:g}ms"


@dataclass(frozen=True)
class Option:
    key: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    metavar: str | None = None

    def shown_default(self) -> str:
        """The default as a user writes it on the command line."""
        if self.parse in (parse_duration, parse_interval, _status_window):
            return format_duration(self.default)
        return str(self.default)


OPTIONS: list[Option] = [
    Option("web.listen-address", _listen, f":{DEFAULT_METRICS_PORT}",
           "address for /metrics, /healthz, the status page / and /api/v1/status (host:port; "
           f"':{DEFAULT_METRICS_PORT}' is every address)"),
    Option("web.tls-cert-file", _text, None, "TLS certificate (PEM) to serve HTTPS", "FILE"),
    Option("web.tls-key-file", _text, None, "TLS private key (PEM) for --web.tls-cert-file",
           "FILE"),
    Option("sampler.interval", parse_duration, 1.0,
           "how often GPUs and host are read (e.g. 1s, 500ms)", "DURATION"),
    Option("gpu.backend", _choice("nvml", "demo"), "nvml",
           "where GPU readings come from: nvml (real GPUs) or demo (simulated)"),
    Option("gpu.peak-flops", parse_peak_overrides, None,
           "dense peak FLOP/s of GPUs the shipped table lacks (or corrects), by NVML device "
           "name: 'NVIDIA L40:bf16=181T,fp32=90.5T;OTHER NAME:...' (the config key takes a "
           "mapping); MFU needs it, an unknown GPU exports no peak", "PEAKS"),
    Option("demo.gpus", _positive_int, 8, "number of simulated GPUs with --gpu.backend=demo",
           "N"),
    Option("demo.load", _fraction, None,
           "busy ratio 0-1 of the demo GPUs (default: a load that moves over time)", "RATIO"),
    Option("demo.foreign-load", _fraction, None,
           "a process that no client reports on demo GPU 0, busy this ratio 0-1 of the time "
           "(to try the share of a GPU that no rank accounts for)", "RATIO"),
    Option("demo.memory-fault", _bool, False,
           "the last demo GPU reports an uncorrectable ECC error and a row remap pending (to "
           "try the GpuTrainGPUMemoryFault alert)"),
    Option("ingest.listen-address", _listen, f"127.0.0.1:{DEFAULT_INGEST_PORT}",
           "address for the training clients' pushes; anything but loopback needs "
           "--ingest.token-file"),
    Option("ingest.token-file", _text, None,
           "file holding the bearer token that pushes must carry", "FILE"),
    Option("ingest.tls-cert-file", _text, None,
           "TLS certificate (PEM) to take pushes over HTTPS (may be the web one)", "FILE"),
    Option("ingest.tls-key-file", _text, None,
           "TLS private key (PEM) for --ingest.tls-cert-file", "FILE"),
    Option("ingest.max-series", _positive_int, 1024, "most live (run, rank) pairs kept", "N"),
    Option("ingest.ttl", parse_duration, 600.0,
           "forget a rank whose pushes stopped this long ago", "DURATION"),
    Option("ingest.dead-ttl", parse_interval, 3600.0,
           "after --ingest.ttl, how long a rank that ended without a clean close (silent "
           "without a goodbye, or failed) is still reported as dead, its counters gone "
           "(0s: forget it with the ttl)", "DURATION"),
    Option("ingest.state-file", _text, None,
           "keep the ranks in this file (written as they end, every 30 s, and at shutdown; "
           "read at start), so that a restart forgets no run that failed or vanished and its "
           "alert does not resolve by itself; its directory must be writable", "FILE"),
    Option("profile.alert-interval", parse_interval, 3600.0,
           "at most one profile per run in this time for the alerts Alertmanager sends to "
           "/api/v1/alerts on the ingest address (0s: no limit)", "DURATION"),
    Option("profile.rank-interval", parse_interval, 30.0,
           "at most one profile of a rank in this time, however asked for (`profile`, "
           "POST /api/v1/profile, an alert); a profile slows the steps it records (0s: no "
           "limit)", "DURATION"),
    Option("host.disk-exclude", _regex, DEFAULT_DISK_EXCLUDE,
           "regular expression of block devices to leave out", "REGEX"),
    Option("host.netdev-exclude", _regex, DEFAULT_NETDEV_EXCLUDE,
           "regular expression of network interfaces to leave out (virtual ones under "
           "/sys/devices/virtual/net are left out too unless this is empty)", "REGEX"),
    Option("host.netdev-speed", parse_link_speeds, None,
           "link speed of interfaces whose driver does not report it (cloud NICs such as "
           "AWS ENA): '25Gbit' for all, or 'eth0=25Gbit,eth1=10Gbit'", "SPEEDS"),
    Option("kubernetes.pod-resources-socket", _text,
           "/var/lib/kubelet/pod-resources/kubelet.sock",
           "the kubelet's pod-resources socket, read by --collector.kubernetes", "PATH"),
    Option("slurm.job-mapping-dir", _text, "/run/gputrain/slurm-gpus",
           "a file per GPU (named by index or UUID) listing the Slurm jobs using it, read by "
           "--collector.slurm; deploy/slurm/gputrain-prolog.sh writes it", "DIR"),
    Option("nccl.inspector-dir", _text, "/var/lib/node_exporter/nccl_inspector",
           "the NCCL_INSPECTOR_DUMP_DIR of NCCL Inspector run with NCCL_INSPECTOR_PROM_DUMP=1, "
           "read by --collector.nccl", "DIR"),
    Option("status.window", _status_window, 300.0,
           "the window the status page, /api/v1/status and `top` judge each run over (the "
           "daemon keeps this much history; 30s-1h)", "DURATION"),
    Option("status.rules-config", _text, None,
           "the settings file of `gputrain-exporter rules --config`: its thresholds make the "
           "status page's verdicts those of your alerts", "FILE"),
    Option("log.level", _choice("debug", "info", "warning", "error"), "info", "log level"),
    *[
        Option(f"collector.{name}", _bool, entry.default,
               f"enable the {name} collector: {entry.help}")
        for name, entry in COLLECTORS.items()
    ],
]
OPTIONS_BY_KEY = {o.key: o for o in OPTIONS}


@dataclass
class Settings:
    """The resolved settings: ``values`` maps each dotted key to its parsed value."""

    values: dict[str, Any] = field(
        default_factory=lambda: {o.key: o.default for o in OPTIONS})

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    @property
    def collectors(self) -> set[str]:
        return {n for n in COLLECTORS if self.values[f"collector.{n}"]}


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping of settings, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in OPTIONS_BY_KEY:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def load_file(path: str) -> dict[str, Any]:
    """Parse a YAML settings file into {key: parsed value}; ConfigError names what is wrong."""
    try:
        data = load_mapping(path)
    except ValueError as exc:
        raise ConfigError(f"config file {exc}") from None
    out = {}
    for key, raw in _flatten(data).items():
        option = OPTIONS_BY_KEY.get(key)
        if option is None:
            known = ", ".join(sorted(OPTIONS_BY_KEY))
            raise ConfigError(f"{path}: unknown key '{key}' (known keys: {known})")
        try:
            out[key] = option.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{path}: key '{key}': {exc}") from None
    return out


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per option (default SUPPRESS, so we can tell which were given)."""
    parser.add_argument("--config.file", dest="config.file", metavar="FILE",
                        default=argparse.SUPPRESS, help="YAML file with any of these settings")
    for o in OPTIONS:
        if o.parse is _bool:  # --name and --no-name
            state = "on" if o.default else "off"
            parser.add_argument(f"--{o.key}", dest=o.key, action="store_true",
                                default=argparse.SUPPRESS, help=f"{o.help} (default: {state})")
            off = (f"disable the {o.key.split('.', 1)[1]} collector"
                   if o.key.startswith("collector.") else f"the opposite of --{o.key}")
            parser.add_argument(f"--no-{o.key}", dest=o.key, action="store_false",
                                default=argparse.SUPPRESS, help=off)
            continue
        default = "" if o.default is None else f" (default: {o.shown_default()})"
        parser.add_argument(f"--{o.key}", dest=o.key, metavar=o.metavar or "VALUE",
                            default=argparse.SUPPRESS, help=o.help + default)


def resolve(namespace: argparse.Namespace) -> Settings:
    """Defaults, then the config file, then flags; raises ConfigError naming the flag or key."""
    given = vars(namespace)
    settings = Settings()
    path = given.get("config.file")
    if path:
        settings.values.update(load_file(path))
    for key, raw in given.items():
        option = OPTIONS_BY_KEY.get(key)
        if option is None:
            continue
        try:
            settings.values[key] = option.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"flag --{key}: {exc}") from None
    return settings


def merge(base: dict, override: dict | None,
          checks: Mapping[str, Callable[[Any], Any]] | None = None, path: str = "") -> dict:
    """``base`` with ``override``'s keys replaced, key by key (nested mappings too); an
    unknown key, or a value of another type than the default's, is a ValueError naming the
    key. ``checks`` maps a key to the function that checks and converts its value."""
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        if key not in base:
            raise ValueError(f"unknown key '{path}{key}' (known: {', '.join(base)})")
        if checks and key in checks:
            out[key] = checks[key](value)
        elif isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ValueError(f"'{path}{key}' must be a mapping")
            out[key] = merge(base[key], value, checks, f"{path}{key}.")
        elif isinstance(base[key], (int, float)) and not isinstance(base[key], bool):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"'{path}{key}' must be a number, got {value!r}")
            out[key] = value
        else:
            out[key] = str(value)
    return out


def load_mapping(path: str | None) -> dict:
    """A YAML file of settings as a mapping ({} without a path); ValueError names the fault."""
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings (key: value), got a "
                         f"{type(data).__name__}")
    return data
