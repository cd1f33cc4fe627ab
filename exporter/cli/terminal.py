"""What the command-line tools print of strings that came from a rank or the network."""

from __future__ import annotations

import re
from typing import Any

# C0 and C1 controls, DEL, Unicode's line separators and bidirectional overrides: what can
# move the cursor, set a title, clear the screen, or make text read other than it is
_CONTROL = "\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_ANY = re.compile(f"[\n{_CONTROL}]")
_ALL_BUT_NEWLINE = re.compile(f"[{_CONTROL}]")


def printable(text: str, newlines: bool = False) -> str:
    """``text`` with every control character written as its escape (``\\x1b``,
    ``\\u202e``), so that a string from a rank or the network cannot drive the terminal;
    ``newlines`` keeps line breaks (a report of several lines)."""
    pattern = _ALL_BUT_NEWLINE if newlines else _ANY
    return pattern.sub(lambda m: ascii(m.group())[1:-1], text)


def printable_doc(doc: Any) -> Any:
    """A JSON document with :func:`printable` applied to every string in it."""
    if isinstance(doc, str):
        return printable(doc)
    if isinstance(doc, list):
        return [printable_doc(v) for v in doc]
    if isinstance(doc, dict):
        return {k: printable_doc(v) for k, v in doc.items()}
    return doc
