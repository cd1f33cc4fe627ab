"""The daemon's serving: HTTP, the /metrics page, the ingest, profiles,
history and the status view."""
