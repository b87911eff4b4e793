"""A config dataclass field that is also a keyword of the strategies: each option written once.

The frozen config dataclasses (:mod:`lightning_zero.config`, :mod:`lightning_zero.zero_config`,
:mod:`lightning_zero.offload_config`, :mod:`lightning_zero.parallel_config`,
:mod:`lightning_zero.ddp_args`) own every option: its type and default are the field's, its docstring
is the docstring under the field. A field becomes a strategy keyword by being declared with
:func:`option`, which says only where the keyword differs from the field: its name
(``offload_pipeline`` for ``OffloadConfig.pipeline``), what the signature accepts (``int | float``
for a size that takes ``5e8``), a default that means "decide later" (``timeout=None``), and how the
keyword's value becomes the field's. :mod:`lightning_zero.options` collects them into
:data:`~lightning_zero.options.OPTIONS`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

#: ``to_field``'s answer for "leave the field at its default".
OMIT: Any = object()
#: ``given``'s default: the keyword's default is the field's.
FIELD_DEFAULT: Any = object()


@dataclasses.dataclass(frozen=True)
class Keyword:
    """A strategy keyword declared on a field (see :func:`option`); ``None`` / ``FIELD_DEFAULT``: the field's."""

    name: str | None = None
    accepts: str | None = None
    given: Any = FIELD_DEFAULT
    doc: str = ""


@dataclasses.dataclass(frozen=True)
class OptionField:
    """What :func:`option` stores in a field's metadata (under ``"option"``)."""

    keywords: tuple[Keyword, ...]
    to_field: Callable[..., Any] | None = None


def option(
    default: Any = dataclasses.MISSING,
    *,
    name: str | None = None,
    accepts: str | None = None,
    given: Any = FIELD_DEFAULT,
    note: str = "",
    to_field: Callable[..., Any] | None = None,
    also: tuple[Keyword, ...] = (),
) -> Any:
    """A dataclass field that is the strategy keyword ``name`` (default: the field's name).

    Args:
        default: the field's default.
        name: the keyword, where it is not the field's name.
        accepts: the keyword's annotation, as the strategies' signatures write it, where it accepts
            more than the field's type (a size given as an integral float, ``5e8``).
        given: the keyword's default, where it is not the field's (``None``: decided at construction).
        note: appended to the field's docstring in the keyword's documentation (what ``given`` means).
        to_field: the field's value from the keyword's value (and those of ``also``, in order);
            :data:`OMIT` leaves the field at its default.
        also: more keywords that make this one field (``nvme_path`` and ``nvme_config``: ``OffloadConfig.nvme``).
    """
    first = Keyword(name=name, accepts=accepts, given=given, doc=note)
    spec = OptionField(keywords=(first, *also), to_field=to_field)
    return dataclasses.field(default=default, metadata={"option": spec})


def integral(config: object, name: str) -> None:
    """Replace a float option that holds a whole number (``5e8``, ``1e5``) by the integer (frozen
    dataclass: set once here); anything else is left for the option's own check to refuse."""
    value = getattr(config, name)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        object.__setattr__(config, name, int(value))
