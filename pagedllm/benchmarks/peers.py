"""Peers: Hugging Face transformers running the same prompts, timed the same way.

Two ways transformers generates: `generate` on one left-padded batch (static batching, the
usual CPU path) and `generate_batch` (its own continuous batching with a paged cache).
Loading is never timed; each peer warms up once before the timed call.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class PeerRun:
    output_tokens: int
    elapsed_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_peer_model(
    model: str | None,
    load_format: str,
    dtype: torch.dtype,
    device: str,
    attn_implementation: str | None = None,
) -> torch.nn.Module:
    """transformers' model for what pagedllm was given as `model`.

    None or a .gguf file: the GGUF's weights, dequantized. A directory with config.json: its
    weights. A preset name, or anything with load_format='dummy': the same shape with
    transformers' own random weights (throughput does not depend on the values).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedllm.loader import default_model_path
    from pagedllm.loader.dummy import preset_config_file

    kwargs = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    path = Path(model).expanduser() if model is not None else None
    preset = preset_config_file(model) if model is not None else None
    if load_format == "dummy" or (preset is not None and not (path and path.exists())):
        config_file = preset or (path / "config.json" if path and path.is_dir() else path)
        if config_file is None or not config_file.is_file() or config_file.suffix != ".json":
            raise ValueError(
                f"the transformers peer needs a preset name or a config.json for dummy weights, "
                f"got {model!r}"
            )
        hf = json.loads(config_file.read_text())
        config = AutoConfig.for_model(hf.pop("model_type"), **hf)
        with torch.device(device):  # random init directly on the device: fast, no host copy
            net = AutoModelForCausalLM.from_config(config, **kwargs)
        return net.eval()
    if path is None or path.suffix == ".gguf":
        gguf = str(path) if path is not None else default_model_path()
        folder, name = os.path.split(gguf)
        net = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **kwargs)
    elif path.is_dir() and (path / "config.json").is_file():
        net = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    else:
        raise ValueError(f"the transformers peer cannot load {model!r}: "
                         "pass a .gguf file, a model directory or a preset name")
    return net.to(device).eval()


def _left_padded(prompts: list[list[int]], pad_id: int, device: torch.device):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def hf_generate(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> PeerRun:
    """One batch of all prompts, left-padded; greedy; exactly max_new_tokens each."""
    device = next(model.parameters()).device
    eos = model.generation_config.eos_token_id
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = (eos[0] if isinstance(eos, list) else eos) or 0
    common = dict(do_sample=False, pad_token_id=pad_id, temperature=None, top_p=None,
                  top_k=None)

    ids, mask = _left_padded(prompts[:2], pad_id, device)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2,
                   **common)  # warm-up
    ids, mask = _left_padded(prompts, pad_id, device)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, **common)
    _sync(device)
    elapsed = time.perf_counter() - start
    return PeerRun(output_tokens=(out.shape[1] - ids.shape[1]) * len(prompts), elapsed_s=elapsed)


# no_grad, not inference_mode: transformers' continuous batching updates tensors in place
# from its own generation thread, where inference tensors may not be modified.
@torch.no_grad()
def hf_generate_batch(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int
) -> PeerRun:
    """transformers' continuous batching; greedy; EOS disabled so every output is full length.

    generate_batch builds its manager (and paged cache) on every call; that setup is part of
    the timed call, as it is for any user of this API.
    """
    from transformers import GenerationConfig

    device = next(model.parameters()).device

    def config(n: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1,
                                pad_token_id=0)

    model.generate_batch(inputs=prompts[:2], generation_config=config(2))  # warm-up
    _sync(device)
    start = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=config(max_new_tokens))
    _sync(device)
    elapsed = time.perf_counter() - start
    return PeerRun(sum(len(o.generated_tokens) for o in outs.values()), elapsed)
