"""py-spy stacks in words: the lines `profile --stacks`, `top` and `diagnose` print.

A record says, per role of the rank's process tree, which functions its samples were in and
their share ("loader workers: 71 % in resize (transforms.py:142)"); a dump says where each
thread is (its innermost frame, and the program's own frame that called into it).
"""

from __future__ import annotations

from typing import Any

from exporter.protocol import STACK_ROLE_WORDS as ROLE_WORDS

FRAMES_SHOWN = 8  # per thread, in a dump's full text


def frame(f: dict[str, Any]) -> str:
    """``function (file:line)``, as py-spy writes a frame."""
    return f"{f['function']} ({f['file']}:{f['line']})" if f.get("file") else f["function"]


def role_line(role: dict[str, Any], top: int = 3) -> str:
    """One role of a record: where its samples were."""
    n = role["processes"]
    head = ROLE_WORDS.get(role["role"], role["role"])
    if role["role"] in ("loader_workers", "other"):
        head += f" ({n} process{'es' if n != 1 else ''})"
    shares = ", ".join(f"{t['share'] * 100:.0f} % in {frame(t)}" for t in role["top"][:top])
    return f"{head}: {shares or 'no sample'}"


def where_line(row: dict[str, Any]) -> str:
    """One thread of a dump's summary (``dump_summary``): where it is."""
    who = f"{ROLE_WORDS.get(row['role'], row['role'])} {row['pid']}"
    if row.get("error"):
        return f"{who}: {row['error']}"
    state = "running" if row.get("active") else "idle"
    text = f"{who} {row['thread']} ({state}): in {frame(row['at'])}"
    if row.get("caller"):
        text += f", from {frame(row['caller'])}"
    return text


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """A finished capture in a few lines (the status document's brief one or the full)."""
    if doc.get("mode") == "record":
        return [role_line(r) for r in doc.get("roles", [])] or [
            "no sample: every thread of the rank was idle"]
    pending = [f"pending collective {c['name']} #{c['seq']:.0f} of group {c['group'] or '?'}, "
               f"started {c['seconds']:.0f} s before the dump (flight recorder)"
               for c in doc.get("collectives", [])[-2:]]
    if "where" in doc:
        return [where_line(r) for r in doc["where"]] + pending
    from exporter.serving.profiles import dump_summary

    return [where_line(r) for r in dump_summary(doc.get("processes", []))] + pending


def render(doc: dict[str, Any]) -> str:
    """A finished capture as text: the file, then each role's functions, or each thread."""
    trigger = "you" if doc["trigger"] == "cli" else "the daemon, as the run hung" \
        if doc["trigger"] == "hang" else f"the alert {doc['trigger'][6:]}"
    if doc["mode"] == "record":
        lines = [f"Stacks {doc['id']}: run {doc['run']}, rank {doc['rank']}, py-spy sampled "
                 f"its processes {doc['seconds_sampled']:.0f} s at {doc['rate']:.0f} Hz "
                 f"({doc['samples']} samples), asked for by {trigger}",
                 f"Flame graph: {doc['file']} ({doc['file_bytes']} bytes; on the rank's "
                 "machine: open it in https://www.speedscope.app)", "",
                 "Where each role spent its time (each process's main thread; a wait is "
                 "charged to the code that waits):"]
        for r in doc["roles"]:
            lines.append("  " + role_line(r, top=5))
        if not doc["roles"]:
            lines.append("  no sample: every thread of the rank was idle")
        if doc.get("warning"):
            lines += ["", f"Warning: {doc['warning']}"]
        return "\n".join(lines)
    lines = [f"Stacks {doc['id']}: run {doc['run']}, rank {doc['rank']}, one py-spy dump of "
             f"every thread of every process, asked for by {trigger}",
             f"Dump: {doc['file']} ({doc['file_bytes']} bytes, on the rank's machine)", ""]
    for p in doc["processes"]:
        head = f"{ROLE_WORDS.get(p['role'], p['role'])} {p['pid']}"
        if p.get("error"):
            lines.append(f"{head}: {p['error']}")
            continue
        lines.append(f"{head}:")
        for t in p["threads"]:
            state = "running" if t["active"] else "idle"
            gil = ", holds the GIL" if t["gil"] else ""
            lines.append(f"  thread {t['tid']} {t['name']} ({state}{gil})")
            for i, f in enumerate(t["frames"][:FRAMES_SHOWN]):
                mark = "  <- the program's own code" if i == t["where"] and i else ""
                lines.append(f"      {frame(f)}{mark}")
            if len(t["frames"]) > FRAMES_SHOWN:
                lines.append(f"      ... {len(t['frames']) - FRAMES_SHOWN} more frames")
    return "\n".join(lines)


STACKS_RECENT_SECONDS = 1800.0  # a capture older than this no longer says what a rank does
GUARDED = "hidden: the ingest token guards it (GET /api/v1/profile)"


def recent_stacks(profile: Any, now: float, guarded: bool = False) -> dict[str, Any] | None:
    """A rank's last py-spy capture as the status document shows it beside the rank's
    verdict: its mode, trigger, age and summary lines; None when there is none or it is older
    than STACKS_RECENT_SECONDS. With an ingest token its lines (functions, files) are
    hidden, as GET /api/v1/profile guards them."""
    if profile is None or profile.finished is None:
        return None
    age = max(0.0, now - profile.finished)
    if age > STACKS_RECENT_SECONDS:
        return None
    return {"mode": profile.mode, "trigger": profile.trigger, "age_seconds": age,
            "lines": [GUARDED] if guarded else summary_lines(profile.document(brief=True))}


def with_lines(doc: dict[str, Any]) -> dict[str, Any]:
    """A profile's document with, where it is finished py-spy stacks, its summary ``lines``
    (the status page prints them as they are)."""
    if doc.get("kind") == "stacks" and doc.get("state") == "done":
        return {**doc, "lines": summary_lines(doc)}
    return doc
