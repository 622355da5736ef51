"""`pagedllm serve --lora-modules name=path ...`: the flag alone, with no heavy import (the
CLI builds its parser before anything loads); the routes are in openai/lora_routes.py."""
from __future__ import annotations

import argparse
import json


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lora-modules", nargs="+", default=None, type=parse_lora_module, metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) to serve from the start, each as name=path or "
        'JSON {"name": ..., "path": ...}; requests pick one by `model` (needs --enable-lora)')


def parse_lora_module(text: str) -> tuple[str, str]:
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return str(spec["name"]), str(spec["path"])
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(
                f'invalid LoRA module {text!r}: JSON needs "name" and "path"') from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"invalid LoRA module {text!r}: give name=path")
    return name, path
