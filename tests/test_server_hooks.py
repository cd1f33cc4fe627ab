"""The aiohttp hooks the daemon's connection class overrides, pinned: an aiohttp release that
renames one, changes its arguments or its return, or drops a keyword the server passes, fails
here by name instead of silently bypassing a connection limit (pyproject pins aiohttp < 4).
"""

from __future__ import annotations

import inspect

import aiohttp
from aiohttp.web_protocol import RequestHandler

from exporter.serving.connections import Connection

# hook -> the parameters the override relies on, in order, after self
HOOKS = {
    "connection_made": ["transport"],
    "connection_lost": ["exc"],
    "data_received": ["data"],
    "eof_received": [],
    "finish_response": ["request", "resp", "start_time"],
    "handle_error": ["request", "status", "exc", "message"],
}
# the keywords Connection.__init__ passes to RequestHandler.__init__
INIT_KEYWORDS = {"loop", "keepalive_timeout", "access_log", "max_line_size", "max_field_size",
                 "max_headers", "lingering_time", "auto_decompress"}


def _params(func) -> list[str]:
    return [p for p in inspect.signature(func).parameters if p != "self"]


def test_aiohttp_is_the_major_version_the_server_was_written_for():
    assert int(aiohttp.__version__.split(".")[0]) == 3, aiohttp.__version__


def test_every_overridden_hook_exists_with_the_arguments_the_override_takes():
    overridden = {n for n, v in vars(Connection).items()
                  if callable(v) and not n.startswith("__") and hasattr(RequestHandler, n)}
    assert overridden == set(HOOKS), "a hook was added or removed: pin it in HOOKS"
    for name, params in HOOKS.items():
        base = getattr(RequestHandler, name)
        assert _params(base) == params, (name, _params(base))
        assert _params(getattr(Connection, name)) == params, name
        # an override of a coroutine stays a coroutine, and of a plain method stays plain
        assert inspect.iscoroutinefunction(base) == \
            inspect.iscoroutinefunction(getattr(Connection, name)), name


def test_the_keywords_the_server_passes_are_still_accepted():
    accepted = set(inspect.signature(RequestHandler.__init__).parameters)
    assert accepted >= INIT_KEYWORDS, INIT_KEYWORDS - accepted
    source = inspect.getsource(Connection.__init__)
    for keyword in INIT_KEYWORDS:
        assert f"{keyword}=" in source, keyword  # the pin lists what is passed, no more


def test_the_state_the_overrides_read_is_still_there():
    """The overrides read the protocol's ``transport`` and close answers with
    ``StreamResponse.force_close``."""
    assert hasattr(RequestHandler, "transport")
    assert callable(getattr(aiohttp.web.StreamResponse, "force_close", None))
