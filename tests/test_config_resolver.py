"""resolve_config: the engine's arguments resolved before any worker exists (no weights, no
tokenizer read), and the tokenizer loaded by rank 0 alone: a tensor-parallel rank > 0 gets
rank 0's EngineConfig (its stop tokens included) and never reads a tokenizer."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import transformers

from pagedllm.engine import config_resolver
from pagedllm.engine.config_resolver import (
    ALLOW_LONG_MAX_MODEL_LEN, load_engine_tokenizer, resolve_config,
)
from pagedllm.engine_args import EngineArgs
from pagedllm.loader import default_model_path, resolve
from tests.dist_helpers import free_port, run_ranks

REPO = Path(__file__).resolve().parents[1]


def refuse_tokenizers(monkeypatch) -> None:
    def refuse(path):
        raise AssertionError(f"a tokenizer was loaded from {path}")

    monkeypatch.setattr(resolve, "load_tokenizer", refuse)
    monkeypatch.setattr(config_resolver, "load_tokenizer", refuse)


def test_resolves_the_default_model_without_its_tokenizer(monkeypatch):
    refuse_tokenizers(monkeypatch)
    config = resolve_config(EngineArgs())
    assert config.tokenizer_path == default_model_path()
    assert config.model_config.architecture == "llama"
    assert config.max_model_len == config.model_config.max_position_embeddings == 8192
    assert config.eos_token_ids == tuple(config.model_config.eos_token_ids)


def test_max_model_len_above_the_models_names_both_numbers(monkeypatch):
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN, raising=False)
    args = EngineArgs(model="smollm2-135m", load_format="dummy", max_model_len=8193)
    with pytest.raises(ValueError) as e:
        resolve_config(args)
    assert str(e.value) == (
        "--max-model-len 8193 is longer than the model's 8192 positions "
        "(max_position_embeddings); set PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it anyway")
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN, "1")
    config = resolve_config(args)
    assert config.max_model_len == config.model_config.max_position_embeddings == 8193
    shorter = resolve_config(EngineArgs(model="smollm2-135m", load_format="dummy",
                                        max_model_len=512))
    assert shorter.max_model_len == 512
    assert shorter.model_config.max_position_embeddings == 8192


def test_rank_0_adds_the_tokenizers_eos_and_other_ranks_load_none(monkeypatch):
    config = resolve_config(EngineArgs())
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    tokenizer, with_eos = load_engine_tokenizer(config)
    assert tokenizer.eos_token_id in with_eos.eos_token_ids
    refuse_tokenizers(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert load_engine_tokenizer(config) == (None, config)


# Rank 1 of a two-process group started as torchrun starts its processes: it runs the
# engine's code as rank 0 does, with every way to a tokenizer refused, and prints the stop
# tokens its worker got (rank 0's, through the broadcast config).
RANK_1 = """
import sys
from pagedllm import LLM
from pagedllm.engine import config_resolver
from pagedllm.loader import resolve
from pagedllm.worker import tp_worker

def refuse(path):
    raise SystemExit(f"rank 1 loaded a tokenizer from {path}")

resolve.load_tokenizer = config_resolver.load_tokenizer = refuse

class Shown(tp_worker.Worker):
    def __init__(self, args, config):
        super().__init__(args, config)
        print("EOS " + repr(self.eos_token_ids), flush=True)

tp_worker.Worker = Shown
LLM(sys.argv[1], tokenizer=sys.argv[2], tensor_parallel_size=2, distributed_timeout=60)
raise SystemExit("rank 1 returned from LLM()")
"""

RANK_0 = """
import json, sys
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1], tokenizer=sys.argv[2], tensor_parallel_size=2, distributed_timeout=60)
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                   use_tqdm=False)[0]
print("RESULT " + json.dumps([sorted(llm.engine.info.eos_token_ids),
                              llm.engine.tokenizer.eos_token_id, len(out.outputs[0].token_ids)]),
      flush=True)
llm.engine.shutdown()
"""


def test_tensor_parallel_rank_1_never_loads_a_tokenizer(tmp_path):
    """A tiny model with the default model's tokenizer, at two ranks on gloo: rank 0's
    engine tokenizes and generates; rank 1 loads no tokenizer, and its worker stops on the
    tokenizer's EOS all the same (rank 0's config)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=7), dtype=torch.float32)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    port = str(free_port())
    envs = [dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", WORLD_SIZE="2",
                 RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for rank in (0, 1)]
    stdouts = run_ranks([[sys.executable, "-c", script, str(tmp_path), default_model_path()]
                         for script in (RANK_0, RANK_1)], envs)
    line = next(x for x in stdouts[0].splitlines() if x.startswith("RESULT "))
    eos_ids, tokenizer_eos, num_tokens = json.loads(line.removeprefix("RESULT "))
    assert tokenizer_eos != 7 and eos_ids == sorted({7, tokenizer_eos}) and num_tokens == 4
    shown = next(x for x in stdouts[1].splitlines() if x.startswith("EOS "))
    assert shown == f"EOS {eos_ids!r}"
