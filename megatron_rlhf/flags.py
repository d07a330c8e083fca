"""Command-line flags generated from the config dataclasses, and the one map from fields to flags.

A field becomes ``--field-name`` (dest: the field name): its type, default and help come from
the field and the docstring under it, its choices from a ``Literal`` type. Field metadata
holds the exceptions: ``flag`` (another name; None: no flag), ``off`` (the flag that sets a
bool False), ``both`` (a default-True bool keeps its on flag too), ``form`` (``"on-off"``:
``--x on|off``), ``metavar`` and ``required``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from functools import cache

from megatron_rlhf.config import CONFIGS, ConfigError


def default_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@cache
def _fields() -> dict[str, dataclasses.Field]:
    out: dict[str, dataclasses.Field] = {}
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, f)
    return out


def flag_of(name: str, off: bool = False) -> str:
    """The flag that sets field ``name`` (``off``: the one that sets it False)."""
    f = _fields().get(name)
    meta = f.metadata if f is not None else {}
    flag = meta.get("flag", default_flag(name)) or name
    if not off:
        return flag
    if meta.get("form") == "on-off":
        return f"{flag} off"
    return meta.get("off") or "--no-" + flag.removeprefix("--")


def cli_message(error: BaseException) -> str:
    """The message a CLI user sees: a ConfigError's fields named by their flags."""
    if isinstance(error, ConfigError):
        return error.render(flag_of)
    return str(error)


def _plain(doc: str) -> str:
    """A field docstring as one line of argparse help (reST markup dropped, ``%`` escaped)."""
    text = " ".join(doc.split())
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: m.group(1), text)
    return text.replace("``", "").replace("%", "%%")


@cache
def field_docs(cls) -> dict[str, str]:
    """``{field: help}`` from the docstring under each field of ``cls`` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = _plain(after.value.value)
    return docs


@cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def field_kinds(cls, name: str) -> tuple[list, tuple]:
    """``(types, literal choices)`` of field ``name``'s annotation in ``cls``, None left out."""
    annotation = _hints(cls)[name]
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    parts = typing.get_args(annotation) if union else (annotation,)
    scalars, choices = [], ()
    for part in parts:
        if part is type(None):
            continue
        if typing.get_origin(part) is typing.Literal:
            choices += typing.get_args(part)
        else:
            scalars.append(part)
    return scalars, choices


def _number_or(choices: tuple):
    def parse(text: str):
        if text in choices:
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer or {' or '.join(choices)}, got {text!r}") from None
    return parse


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def _add_bool(g, f: dataclasses.Field, flag: str, help_: str) -> None:
    meta, off = f.metadata, flag_of(f.name, off=True)
    if meta.get("form") == "on-off":
        g.add_argument(flag, dest=f.name, type=_on_off, default=f.default, metavar="{on,off}", help=help_)
    elif f.default is None or meta.get("both"):
        x = g.add_mutually_exclusive_group()
        x.add_argument(flag, dest=f.name, action="store_true", default=f.default, help=help_)
        x.add_argument(off, dest=f.name, action="store_false", default=f.default,
                       help=f"the opposite of {flag}")
    elif f.default:
        g.add_argument(off, dest=f.name, action="store_false", default=True, help=f"{help_} On by default: this flag turns it off.")
    else:
        g.add_argument(flag, dest=f.name, action="store_true", default=False, help=help_)


def add_fields(g, cls, *, only=(), exclude=()) -> None:
    """Add a flag for each field of dataclass ``cls`` to parser or group ``g``: those in
    ``only`` (when given), not in ``exclude``, and not already a dest of the parser."""
    taken = {a.dest for a in g._actions}
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if (only and f.name not in only) or f.name in exclude or f.name in taken:
            continue
        flag = f.metadata.get("flag", default_flag(f.name))
        if flag is None:
            continue
        scalars, choices = field_kinds(cls, f.name)
        if scalars == [bool]:
            _add_bool(g, f, flag, docs[f.name])
            continue
        kw = dict(dest=f.name, help=docs[f.name])
        if f.metadata.get("required"):
            kw["required"] = True
        else:
            kw["default"] = f.default
        if choices and scalars:
            kw["type"] = _number_or(choices)
        elif choices:
            kw["choices"] = choices
        elif scalars[0] in (int, float):
            kw["type"] = scalars[0]
        if "metavar" in f.metadata:
            kw["metavar"] = f.metadata["metavar"]
        g.add_argument(flag, **kw)
