"""YAML files and dotted overrides into the TrainConfig tree, with one-line errors.

Each value is checked against its field's annotation as it is read, so a typo or a wrong
type is reported with the key's full dotted name (and the nearest valid names for an
unknown key) before anything heavier than PyYAML has run.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import pathlib
import types
import typing
from collections.abc import Mapping
from typing import Any, Iterable

import yaml

from lp_jax.config.schema import FrozenMapping, PrecisionConfig, TrainConfig
from lp_jax.errors import UserError


def load_config(path: str | pathlib.Path | None = None, overrides: Iterable[str] = ()) -> TrainConfig:
    """Reads a YAML file (None: all defaults) and applies ``key=value`` overrides in order."""
    raw: Any = {}
    if path is not None:
        path = pathlib.Path(path)
        if path.is_dir():
            raise UserError(f"config file {str(path)!r} is a folder, not a YAML file")
        if not path.is_file():
            raise UserError(f"config file {str(path)!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise UserError(f"config file {str(path)!r} is not UTF-8 text (byte "
                            f"{e.object[e.start]:#04x} at offset {e.start})") from None
        except OSError as e:
            raise UserError(f"config file {str(path)!r} cannot be read: "
                            f"{e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise UserError(f"config file {str(path)!r} is not valid YAML: "
                            f"{' '.join(str(e).split())}") from None
        if not isinstance(raw, dict):
            raise UserError(f"config file {str(path)!r} must hold a mapping of keys, "
                            f"got {type(raw).__name__}")
    config = from_dict(TrainConfig, raw)
    return apply_overrides(config, overrides)


def from_dict(cls: type, raw: dict, prefix: str = "") -> Any:
    """Builds dataclass ``cls`` from a mapping, checking every key and value."""
    hints = _hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in hints:
            raise UserError(_unknown_key(prefix, str(key), list(hints)))
        kwargs[key] = coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def apply_overrides(config: TrainConfig, overrides: Iterable[str]) -> TrainConfig:
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r} must look like key=value "
                            f"(for example steps=20 or optimizer.b2=0.99)")
        config = set_dotted(config, key.strip(), parse_value(text))
    return config


def parse_value(text: str) -> Any:
    """YAML scalar syntax (20, 0.5, true, null, [a, b]); anything else stays a string."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def set_dotted(node: Any, dotted: str, value: Any, prefix: str = "") -> Any:
    """A copy of dataclass ``node`` with the field at ``dotted`` (a.b.c) set to ``value``."""
    head, _, rest = dotted.partition(".")
    hints = _hints(type(node))
    if head not in hints:
        raise UserError(_unknown_key(prefix, head, list(hints)))
    name = f"{prefix}{head}"
    current = getattr(node, head)
    if rest and (isinstance(current, Mapping) or (current is None and _is_mapping(hints[head]))):
        new = _set_in_mapping(current or FrozenMapping(), rest, value, prefix=f"{name}.")
    elif rest:
        if not dataclasses.is_dataclass(current):
            raise UserError(f"config key {name!r} has no sub-keys (it holds "
                            f"{_type_name(hints[head])}), so {prefix + dotted!r} is not a key")
        new = set_dotted(current, rest, value, prefix=f"{name}.")
    elif isinstance(current, PrecisionConfig) and isinstance(value, str):
        # `precision=nvfp4` changes the recipe and keeps any FiLj/ablation overrides.
        new = dataclasses.replace(current, recipe=value)
    else:
        new = coerce(hints[head], value, name)
    return dataclasses.replace(node, **{head: new})


def _set_in_mapping(mapping: FrozenMapping, dotted: str, value: Any, prefix: str) -> FrozenMapping:
    """``precision.options.scale_rule=floor``: the keys below a mapping section are whatever
    it holds, so any name is set (the recipe checks them when the run is validated)."""
    head, _, rest = dotted.partition(".")
    if not head:
        raise UserError(f"config key {prefix + dotted!r} has an empty part")
    if rest:
        current = mapping.get(head)
        if current is not None and not isinstance(current, Mapping):
            raise UserError(f"config key {prefix + head!r} holds {current!r}, so "
                            f"{prefix + dotted!r} is not a key")
        value = _set_in_mapping(current or FrozenMapping(), rest, value, f"{prefix}{head}.")
    return mapping.replace(**{head: value})


def _is_mapping(hint: Any) -> bool:
    """A FrozenMapping section, null allowed or not."""
    return FrozenMapping in (hint, *typing.get_args(hint))


def to_dict(config: Any) -> Any:
    """The plain-data form of a config (for config.yaml in the run folder and checkpoints)."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, Mapping):
        return {k: to_dict(v) for k, v in config.items()}
    if isinstance(config, tuple):
        return [to_dict(v) for v in config]
    return config


# Keys that may change between sessions of one run without making it another run (the
# quant-stats probe runs beside the step and changes nothing in it).
SESSION_KEYS = frozenset({"stop_at", "run_dir", "checkpoint.dir", "logging.progress_bar",
                          "logging.quant_stats_every", "checkpoint.preempted_exit_code",
                          "data.allow_changed"})


def changed_keys(saved: dict, current: dict, ignore=SESSION_KEYS) -> list[str]:
    """Sorted dotted keys whose values differ between two config mappings (``ignore``
    aside); a key present on one side only counts as changed."""
    old, new = _flatten(saved), _flatten(current)
    return sorted(k for k in old.keys() | new.keys() if k not in ignore and old.get(k) != new.get(k))


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def with_defaults(raw: dict) -> dict:
    """A saved config mapping with the keys it lacks filled in with their defaults, so a
    run written before a key existed compares equal to one that leaves it at its default.
    A mapping that no longer loads (a key since removed) is returned as it is."""
    try:
        return to_dict(from_dict(TrainConfig, raw))
    except (UserError, TypeError, ValueError):
        return raw


def dump_yaml(config: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def all_keys(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the tree (docs and the tests that check the docs use it)."""
    keys = []
    for name, hint in _hints(cls).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(hint):
            keys.extend(all_keys(hint, f"{prefix}{name}."))
    return keys


_BLEND_KEYS = ("data.paths", "data.val_paths")  # lists that may hold Megatron blend weights


def _is_weight(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def coerce(hint: Any, value: Any, name: str) -> Any:
    """``value`` as type ``hint``, or a UserError naming key ``name``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return coerce(inner, value, name)
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            value = [value]  # `data.paths=a/*.txt`: one element
        if name in _BLEND_KEYS and len(value) >= 2 and _is_weight(value[0]):
            # Megatron's blend [0.3, prefix, 0.7, prefix]: YAML reads the weights as numbers
            value = [str(v) if _is_weight(v) else v for v in value]
        return tuple(coerce(args[0], v, f"{name}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        if hint is PrecisionConfig and isinstance(value, str):
            return PrecisionConfig(recipe=value)  # `precision: nvfp4` shorthand
        if not isinstance(value, dict):
            raise UserError(f"config key {name!r} must be a mapping of "
                            f"{', '.join(_hints(hint))}; got {value!r}")
        return from_dict(hint, value, prefix=f"{name}.")
    if hint is FrozenMapping:
        if value is None:  # `options:` with nothing under it
            return FrozenMapping()
        if not isinstance(value, Mapping):
            raise UserError(f"config key {name!r} must be a mapping, got {value!r}")
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise UserError(f"config key {name!r} has a key {bad[0]!r} that is not a name")
        return FrozenMapping(value)
    if origin is typing.Literal:  # a recipe field's choices: the recipe names them when it checks
        return _scalar(type(args[0]), value, name)
    return _scalar(hint, value, name)


def _scalar(hint: type, value: Any, name: str) -> Any:
    bad = UserError(f"config key {name!r} must be {_type_name(hint)}, "
                    f"got {value!r} ({type(value).__name__})")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if isinstance(value, bool):  # bool is an int subclass: true is not a step count
        raise bad
    if hint is int:
        if isinstance(value, int):
            return value
        try:  # 2000.0 or "1e3" (PyYAML reads 1e3 as a string)
            as_float = float(value)
        except (TypeError, ValueError):
            raise bad from None
        if as_float.is_integer():
            return int(as_float)
        raise bad
    if hint is float:
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:  # PyYAML reads 6e-4 (no dot) as a string
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if hint is str:
        if isinstance(value, str):
            return value
        raise bad
    raise TypeError(f"unsupported config field type {hint!r} for {name}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    names = [f.name for f in dataclasses.fields(cls)]
    hints = typing.get_type_hints(cls)
    return {n: hints[n] for n in names}


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return f"{_type_name(inner[0])} or null"
    if origin is tuple:
        return f"a list of {_type_name(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if dataclasses.is_dataclass(hint) or hint is FrozenMapping:
        return "a mapping"
    if origin is typing.Literal:
        return _type_name(type(args[0]))
    return {int: "an integer", float: "a number", bool: "true or false",
            str: "a string"}.get(hint, str(hint))


def _unknown_key(prefix: str, key: str, valid: list[str]) -> str:
    # Candidates: this section's keys, every key of the tree by its last name (the key may
    # live in another section), and names users bring from other trainers (lr, train_iters).
    pool = {k.rsplit(".", 1)[-1]: k for k in reversed(all_keys())}
    pool.update(_ALIASES)
    pool.update({v: prefix + v for v in valid})
    close = difflib.get_close_matches(key, list(pool), n=5, cutoff=0.6)
    targets = list(dict.fromkeys(pool[c] for c in close))[:3]
    where = f"in {prefix[:-1]!r}" if prefix else "at the top level"
    if targets:
        hint = "did you mean " + " or ".join(repr(t) for t in targets) + "?"
    else:
        hint = f"valid keys {where}: {', '.join(valid)}"
    return f"unknown config key {prefix + key!r}; {hint}"


# Names users bring from Megatron Bridge / other trainers, pointed at ours.
_ALIASES = {
    "lr": "schedule.peak_lr", "learning_rate": "schedule.peak_lr",
    "lr_warmup_iters": "schedule.warmup_steps", "lr_decay_iters": "schedule.decay_steps",
    "train_iters": "steps", "seq_length": "data.seq_len", "adam_eps": "optimizer.eps",
    "save_interval": "checkpoint.every", "eval_interval": "logging.val_every",
}
