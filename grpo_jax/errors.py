"""One base class for every failure a user can act on: the programs print it as one line."""

from __future__ import annotations


class GrpoJaxError(Exception):
    """A problem with the run's input or surroundings; the message names it and the fix."""


class ConfigError(GrpoJaxError, ValueError):
    """A config key or value that can't be used."""


def check(ok: bool, msg: str) -> None:
    """Raise ConfigError(msg) unless `ok`: the settings dataclasses validate with this."""
    if not ok:
        raise ConfigError(msg)
