"""Errors a user can cause, with one message shape: the key and value as written, the rule, the fix."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value breaks a rule. Raised at start-up, before any worker process starts."""

    def __init__(self, key: str, value: Any, rule: str, fix: str) -> None:
        self.key = key
        self.value = value
        self.rule = rule
        self.fix = fix
        super().__init__(f"{key}={value!s}: {rule}; {fix}")


class RecoveryError(RuntimeError):
    """Recovery could not restore training (after bounded retries, or with no usable source)."""


class SummaryError(RuntimeError):
    """Training ended but the job's summary could not be put together (a record that never came)."""
