"""A script that fails at once (the launcher must stop with its exit code and leave nothing running)."""

raise SystemExit(3)
