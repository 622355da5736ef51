"""The models one `pagedllm serve` serves: `--model a --model b` (each its own engine; with
N models, --served-model-name takes N names, one per model in order), or `--models-config
FILE` (JSON or YAML: a list of per-model engine options, e.g. `model`, `served_model_name`,
`kv_cache_memory`, `gpu_memory_utilization`, `lora_modules`, over the command line's as
defaults). The command line's --lora-modules are the first model's; another model's
adapters are its `lora_modules` in the config. A request naming an adapter goes to the
model holding it (openai/multi_model.py).

Each model gets its own share of memory: on CUDA the models' `gpu_memory_utilization` are
shares of the device that must add up to at most 1; the models that set none split the
command line's (default 0.9) evenly, less what the others set. The k-th engine, loaded after
the ones before it, may use up to the sum of the first k shares, so it gets its own share
whatever the others took. On the CPU the `kv_cache_memory` values must fit in the free RAM.
"""
from __future__ import annotations

import argparse
import copy
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from pagedllm.entrypoints.usage import UsageError


class ModelsAction(argparse.Action):
    """--model, repeatable on `serve`: the last one in `model` (the single-model path) and
    every one in `models`."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.models = [*(getattr(namespace, "models", None) or []), values]


def add_models_args(parser: argparse.ArgumentParser) -> None:
    """Make the parser's --model repeatable and add --models-config (after the engine's)."""
    for action in parser._actions:
        if "--model" in action.option_strings:
            action.__class__ = ModelsAction
    parser.set_defaults(models=None)
    parser.add_argument("--models-config", default=None, metavar="FILE",
                        help="several models, one engine each: a JSON or YAML list of "
                        "per-model engine options (model, served_model_name, "
                        "kv_cache_memory, gpu_memory_utilization, ...)")


def model_namespaces(args: argparse.Namespace) -> list[argparse.Namespace]:
    """One namespace of options per model to serve (the given one when it is one model)."""
    models = args.models or []
    if args.models_config is not None:
        if len(models) > 0:
            raise UsageError("give the models by --model or by --models-config, not both")
        entries = _read_config(args.models_config)
    elif len(models) > 1:
        entries = [{"model": model} for model in models]
        names = args.served_model_name
        if names is not None:
            names = [names] if isinstance(names, str) else list(names)
            if len(names) != len(models):
                raise UsageError(f"with {len(models)} --model, --served-model-name takes "
                                 f"{len(models)} names (one per model, in order), got "
                                 f"{len(names)}")
            for entry, name in zip(entries, names):
                entry["served_model_name"] = name
    else:
        return [args]
    namespaces = []
    for entry in entries:
        ns = copy.copy(args)
        ns.served_model_name = None  # the command line's names were one per model
        if namespaces:  # the command line's --lora-modules are the first model's
            ns.lora_modules = None
        for key, value in entry.items():
            setattr(ns, key, value)
        namespaces.append(ns)
    check_memory_split(_number(args.gpu_memory_utilization), entries, namespaces)
    return namespaces


def _read_config(path: str) -> list[dict[str, Any]]:
    from pagedllm.engine_args import EngineArgs

    where = f"--models-config {path}"
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where}: cannot read it: {exc}") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            entries = yaml.safe_load(text)
        else:
            entries = json.loads(text)
    except Exception as exc:  # yaml's and json's errors alike
        raise UsageError(f"{where}: not valid {'YAML' if 'yaml' in path else 'JSON'}: "
                         f"{str(exc).splitlines()[0]}") from None
    if isinstance(entries, dict) and isinstance(entries.get("models"), list):
        entries = entries["models"]
    if not isinstance(entries, list) or not entries or not all(
            isinstance(e, dict) for e in entries):
        raise UsageError(f"{where}: a non-empty list of per-model option objects")
    known = {f.name for f in fields(EngineArgs)} | {"lora_modules"}
    for i, entry in enumerate(entries):
        for key in entry:
            if key.replace("-", "_") not in known:
                raise UsageError(f"{where}: model {i}: unknown option {key!r} (engine "
                                 f"options are `pagedllm serve --help`'s, e.g. model, "
                                 "served_model_name, kv_cache_memory, gpu_memory_utilization)")
    entries = [{k.replace("-", "_"): v for k, v in entry.items()} for entry in entries]
    for i, entry in enumerate(entries):
        if "lora_modules" in entry:
            entry["lora_modules"] = _lora_modules(where, i, entry["lora_modules"])
    return entries


def _lora_modules(where: str, i: int, modules: Any) -> list[tuple[str, str]]:
    """A model's `lora_modules`: a list of "name=path" or {"name": ..., "path": ...}."""
    from pagedllm.entrypoints.lora_flags import parse_lora_module

    if not isinstance(modules, list):
        raise UsageError(f"{where}: model {i}: lora_modules is a list of name=path")
    try:
        return [parse_lora_module(m if isinstance(m, str) else json.dumps(m))
                for m in modules]
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"{where}: model {i}: {exc}") from None


def check_memory_split(total: float | None, entries: list[dict[str, Any]],
                       namespaces: list[argparse.Namespace]) -> None:
    """Refuse shares that cannot fit; give each CUDA engine its cumulative share. `total`:
    the command line's gpu_memory_utilization, split among the models that set none."""
    from pagedllm.worker.memory import available_host_memory

    own = [_number(e["gpu_memory_utilization"]) if "gpu_memory_utilization" in e else None
           for e in entries]
    unset = [ns for ns, share in zip(namespaces, own) if share is None]
    if total is not None and all(
            share is not None or "gpu_memory_utilization" not in e
            for share, e in zip(own, entries)):  # per-device lists: the engine's to check
        given = sum(share for share in own if share is not None)
        listed = ", ".join(f"{label(ns)}: {share:g}" for ns, share in zip(namespaces, own)
                           if share is not None)
        if given > 1.0 + 1e-9:
            raise UsageError(f"the models' gpu_memory_utilization add up to {given:g} "
                             f"({listed}), more than the whole device (1)")
        rest = total - given
        if unset and rest <= 1e-9:
            raise UsageError(f"the models' gpu_memory_utilization ({listed}) leave none of "
                             f"--gpu-memory-utilization {total:g} to "
                             f"{', '.join(map(label, unset))}")
        shares = [share if share is not None else rest / len(unset) for share in own]
        for k, ns in enumerate(namespaces):
            ns.gpu_memory_utilization = min(1.0, sum(shares[:k + 1]))
    kv = [(ns, _number(ns.kv_cache_memory)) for ns in namespaces]
    kv = [(ns, value) for ns, value in kv if value is not None]
    free = available_host_memory()
    if sum(value for _, value in kv) > free:
        listed = ", ".join(f"{label(ns)}: {int(v)}" for ns, v in kv)
        raise UsageError(f"the models' kv_cache_memory add up to "
                         f"{int(sum(v for _, v in kv))} bytes ({listed}), more than the "
                         f"{free} bytes of RAM free")


Names = tuple[str, list[str], list[str]]  # a model's label, served names, adapter names


def adapter_name_clash(models: list[Names]) -> str | None:
    """Why these models' adapters cannot all be served: an adapter name used twice, or one
    a base model is served as (a request's `model` must pick one thing); None if none."""
    owner: dict[str, str] = {}
    for model, _, adapters in models:
        for name in adapters:
            if name in owner:
                where = (f"twice by {model}" if owner[name] == model
                         else f"by {owner[name]} and by {model}")
                return (f"the LoRA adapter name {name!r} is given {where}: adapter names "
                        "are unique across the server")
            owner[name] = model
    bases = {name for _, served, _ in models for name in served}
    clash = next((name for name in owner if name in bases), None)
    if clash is None:
        return None
    return (f"the LoRA adapter {clash!r} of {owner[clash]} is named like a served base "
            "model: give it another name")


def names_before_loading(ns: argparse.Namespace) -> Names:
    """What is known of a model's names before it loads: the --served-model-name given
    (its default name comes from the weights) and its --lora-modules."""
    served = ns.served_model_name
    served = [served] if isinstance(served, str) else list(served or [])
    return label(ns), served, [name for name, _ in getattr(ns, "lora_modules", None) or []]


def check_adapter_names(namespaces: list[argparse.Namespace]) -> None:
    clash = adapter_name_clash([names_before_loading(ns) for ns in namespaces])
    if clash is not None:
        raise UsageError(clash)


def _number(value: Any) -> float | None:
    """A single number (a per-device list "a,b" is left to the engine)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def label(ns: argparse.Namespace) -> str:
    name = ns.served_model_name
    if isinstance(name, list):
        name = name[0] if name else None
    return str(name or ns.model or "the default model")
