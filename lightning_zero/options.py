"""What the Trainer and Fabric strategies share before any process exists: their options and their precision.

Every option is written once, as a field of a frozen config dataclass declared with
:func:`lightning_zero.option_fields.option` (its type, default and docstring are the field's; the
declaration says where the keyword differs: its name, what it accepts, a default that means "decide
at construction"). :data:`OPTIONS` collects them, in the order of :class:`~lightning_zero.config.StrategyConfig`'s
sections. From that one table:

* :func:`strategy_config` turns the keywords into the one validated :class:`~lightning_zero.config.StrategyConfig`
  (its signature is derived from the table);
* :func:`check_signature` compares a strategy's explicit signature (which LightningCLI and jsonargparse
  read: :class:`lightning_zero.ZeroStrategy`) with the table when the strategy's module is imported,
  and raises ``TypeError`` naming the difference;
* :func:`document` writes the options into a strategy's docstring (``Args:``), which LightningCLI's help reads.

:func:`as_offload_precision` converts whatever precision plugin Lightning or Fabric assigns a strategy
chosen by name into an :class:`~lightning_zero.OffloadPrecision` with the same precision string
(:func:`strategy_precision`: and checks it against the strategy's DeepSpeed config).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

from lightning.fabric.plugins.precision import Precision as FabricPrecision

from lightning_zero.config import LossScaleConfig, StrategyConfig, normalize_precision
from lightning_zero.deepspeed_config import DeepSpeedConfig, check_precision
from lightning_zero.option_fields import FIELD_DEFAULT, OMIT, OptionField
from lightning_zero.precision import OffloadPrecision


@dataclasses.dataclass(frozen=True)
class Option:
    """One keyword of the strategies, as its config field declares it."""

    name: str
    """The keyword."""
    annotation: str
    """Its annotation, as the strategies' signatures write it."""
    default: Any
    """Its default in the strategies' signatures."""
    doc: str
    """Its documentation: the field's docstring (and the declaration's note)."""
    section: str
    """The :class:`~lightning_zero.config.StrategyConfig` field (section) it goes into."""
    field: str
    """The section's field it makes."""


def _field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under the fields of dataclass ``cls`` (read from its source)."""
    docs: dict[str, str] = {}
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # no source shipped (a frozen application): the options stay undocumented
        return docs
    body = ast.parse(textwrap.dedent(source)).body[0]
    assert isinstance(body, ast.ClassDef)
    for node, after in itertools.pairwise(body.body):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            assert isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


# A section's class and its declared fields: (field name, declaration, the keywords' names)
_Declared = list[tuple[str, OptionField, tuple[str, ...]]]


def _collect() -> tuple[tuple[Option, ...], dict[str, tuple[type, _Declared]]]:
    options: list[Option] = []
    sections: dict[str, tuple[type, _Declared]] = {}
    for section in dataclasses.fields(StrategyConfig):
        cls = section.default_factory
        assert isinstance(cls, type)
        docs, declared = _field_docs(cls), []
        for f in dataclasses.fields(cls):
            spec = f.metadata.get("option")
            if spec is None:
                continue
            names = tuple(keyword.name or f.name for keyword in spec.keywords)
            declared.append((f.name, spec, names))
            for keyword in spec.keywords:
                default = f.default if keyword.given is FIELD_DEFAULT else keyword.given
                doc = keyword.doc if keyword is not spec.keywords[0] else f"{docs.get(f.name, '')} {keyword.doc}"
                annotation = keyword.accepts or str(f.type)
                name = keyword.name or f.name
                options.append(Option(name, annotation, default, doc.strip(), section.name, f.name))
        sections[section.name] = (cls, declared)
    return tuple(options), sections


#: Every option of the strategies, by section of :class:`~lightning_zero.config.StrategyConfig`.
OPTIONS, _SECTIONS = _collect()
#: The options' names (the Trainer strategy passes its own on by these names).
STRATEGY_OPTIONS = tuple(option.name for option in OPTIONS)
_BY_NAME = {option.name: option for option in OPTIONS}


def strategy_config(**given: Any) -> StrategyConfig:
    """Every ZeRO option of a strategy, validated once (``ValueError`` naming the bad value and the fix).

    The keywords are :data:`OPTIONS` (those of :class:`lightning_zero.ZeroStrategy` without Lightning's
    own and ``loss_scale``, which belongs to the precision plugin); any other keyword is one of torch
    ``DistributedDataParallel``'s (:class:`~lightning_zero.ddp_args.DataParallelConfig`: accepted with
    its ZeRO meaning, refused, or a ``TypeError``)."""
    torch_kwargs = {name: value for name, value in given.items() if name not in _BY_NAME}
    built: dict[str, Any] = {}
    for section, (cls, declared) in _SECTIONS.items():
        values: dict[str, Any] = {}
        for field_name, spec, names in declared:
            args = [given.get(name, _BY_NAME[name].default) for name in names]
            value = spec.to_field(*args) if spec.to_field is not None else args[0]
            if value is not OMIT:
                values[field_name] = value
        if section == "data_parallel":
            values["torch_kwargs"] = torch_kwargs
        built[section] = cls(**values)
    return StrategyConfig(**built)


strategy_config.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.annotation)
        for o in OPTIONS
    ]
    + [inspect.Parameter("ddp_kwargs", inspect.Parameter.VAR_KEYWORD, annotation="Any")],
    return_annotation="StrategyConfig",
)


def check_signature(function: Callable[..., Any], own: Iterable[str], every_option: bool = True) -> None:
    """``TypeError`` unless ``function``'s parameters are the options of :data:`OPTIONS` (each with the
    table's default and annotation) and the names in ``own`` (the API's own arguments). With
    ``every_option=False`` the options it names explicitly are checked (the rest come through ``**options``).
    Called when a strategy's module is imported, so that a signature out of step with the table fails
    at once."""
    where = getattr(function, "__qualname__", repr(function))
    parameters = {
        name: p
        for name, p in inspect.signature(function).parameters.items()
        if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    }
    own = set(own)
    problems = [
        f"{name!r} is neither an option nor one of its own arguments"
        for name in parameters
        if name not in _BY_NAME and name not in own
    ]
    for option in OPTIONS:
        parameter = parameters.get(option.name)
        if parameter is None:
            if every_option:
                problems.append(f"option {option.name!r} is missing")
            continue
        if parameter.default is not option.default and parameter.default != option.default:
            problems.append(f"{option.name}={parameter.default!r}, but the option's default is {option.default!r}")
        if str(parameter.annotation) != option.annotation:
            problems.append(f"{option.name}: {parameter.annotation}, but the option is {option.annotation}")
    if problems:
        raise TypeError(
            f"{where}'s signature is out of step with the options (lightning_zero.options.OPTIONS, declared on the "
            f"config dataclasses): {'; '.join(problems)}. Change the signature or the field's option(...)."
        )


def document(docstring: str | None, names: Iterable[str] | None = None) -> str:
    """``docstring`` with the options (``names``, default all of :data:`OPTIONS`) added to its ``Args:``
    section, in Google style, one entry each from its field's docstring."""
    chosen = OPTIONS if names is None else tuple(_BY_NAME[n] for n in names)
    text = inspect.cleandoc(docstring or "")
    entries = []
    for option in chosen:
        lines = textwrap.wrap(
            f"{option.name}: {option.doc}", width=100, initial_indent="    ", subsequent_indent="        "
        )
        entries.extend(lines)
    if "\nArgs:\n" not in text:
        return f"{text}\n\nArgs:\n" + "\n".join(entries)
    return text.replace("\nArgs:\n", "\nArgs:\n" + "\n".join(entries) + "\n", 1)


def new_precision(
    precision: str, config: StrategyConfig, loss_scale: LossScaleConfig | None, cls: type[OffloadPrecision]
) -> OffloadPrecision:
    """A ``cls`` (an :class:`OffloadPrecision`) for ``precision`` with the strategy's offload options."""
    return cls(
        precision,
        offload_optimizer=config.offload.offload_optimizer,
        offload_parameters=config.offload.offload_parameters,
        pin_memory=config.offload.pin_memory,
        loss_scale=loss_scale,
        nvme=config.offload.nvme,
    )


def as_offload_precision(
    plugin: FabricPrecision | None,
    config: StrategyConfig,
    loss_scale: LossScaleConfig | None,
    cls: type[OffloadPrecision] = OffloadPrecision,
) -> OffloadPrecision | None:
    """Lightning and Fabric assign a generic plugin to a strategy chosen by name: keep its precision
    string (and, for an ``OffloadPrecision`` of another class, its own offload options)."""
    if plugin is None or isinstance(plugin, cls):
        return plugin
    if isinstance(plugin, OffloadPrecision):
        scale = plugin.scaler.config if plugin.scaler is not None else loss_scale
        converted = cls(
            plugin.precision,
            offload_optimizer=plugin.offload.offload_optimizer,
            offload_parameters=plugin.offload.offload_parameters,
            pin_memory=plugin.offload.pin_memory,
            loss_scale=scale,
            nvme=plugin.offload.nvme,
            param_dtype="fp32" if plugin.fp32_params else None,
        )
        return converted
    # (A plugin given to the strategy itself reaches here unchanged: Lightning prefers it to the
    # Trainer's precision flag.)
    requested = normalize_precision(getattr(plugin, "precision", "32-true"))
    return new_precision(requested, config, loss_scale, cls)


def strategy_precision(
    plugin: FabricPrecision | None,
    config: StrategyConfig,
    loss_scale: LossScaleConfig | None,
    deepspeed: DeepSpeedConfig | None,
    cls: type[OffloadPrecision] = OffloadPrecision,
) -> OffloadPrecision | None:
    """What a strategy keeps of the precision plugin Lightning or Fabric assigns it: the plugin as a
    ``cls`` (:func:`as_offload_precision`), whose precision the DeepSpeed config (``config=``) must allow."""
    converted = as_offload_precision(plugin, config, loss_scale, cls)
    if converted is not None:
        check_precision(deepspeed, converted.precision)
    return converted


#: The names both strategy registries (Lightning's ``StrategyRegistry`` and Fabric's ``STRATEGY_REGISTRY``)
#: get when the package is imported: name -> (description, the strategy's keyword arguments).
REGISTERED_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    **{f"zero{stage}": (f"lightning_zero ZeRO stage {stage}", {"stage": stage}) for stage in (1, 2, 3)},
    "zero2_offload": (
        "lightning_zero ZeRO stage 2, optimizer offloaded to the CPU",
        {"stage": 2, "offload_optimizer": True},
    ),
    "zero3_offload": (
        "lightning_zero ZeRO stage 3, optimizer and parameters offloaded to the CPU",
        {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    ),
}


def register_names(registry: Any, cls: type) -> None:
    """Register :data:`REGISTERED_NAMES` for ``cls`` in a Lightning or Fabric strategy registry."""
    for name, (description, init_params) in REGISTERED_NAMES.items():
        registry.register(name, cls, description=description, override=True, **init_params)
