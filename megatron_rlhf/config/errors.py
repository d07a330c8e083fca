"""ConfigError and the checks the config dataclasses share.

A message names its settings as ``{field}`` (``{!field}``: the field set to False); ``str()``
shows field names, :func:`megatron_rlhf.flags.cli_message` the flags."""

from __future__ import annotations

import dataclasses
import math
import re

_TOKEN = re.compile(r"\{(!?)([A-Za-z_*][A-Za-z0-9_*]*)\}")


class ConfigError(ValueError):
    """An invalid setting. ``template`` holds ``{field}`` tokens; ``fields`` lists them in order."""

    def __init__(self, template: str) -> None:
        self.template = template
        self.fields = tuple(m.group(2) for m in _TOKEN.finditer(template))
        super().__init__(self.render(lambda name, off: f"{name}=False" if off else name))

    def render(self, name) -> str:
        """The message with each token replaced by ``name(field, off)``."""
        return _TOKEN.sub(lambda m: name(m.group(2), bool(m.group(1))), self.template)


def positive(name: str, value) -> None:
    # name: a field, or a phrase such as "tensor parallel size"
    if not isinstance(value, int) or value <= 0:
        label = f"{{{name}}}" if name.isidentifier() else name
        raise ConfigError(f"{label} must be a positive integer, got {value!r}")


def nonnegative(config, *names: str) -> None:
    """Raise naming the first of ``config``'s fields ``names`` below 0."""
    for name in names:
        if getattr(config, name) < 0:
            raise ConfigError(f"{{{name}}} must be >= 0, got {getattr(config, name)}")


def finite(config) -> None:
    """Raise naming the first float field of ``config`` that holds NaN or an infinity."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{{{f.name}}} must be a finite number, got {value}")
