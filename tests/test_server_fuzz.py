"""Schema-driven fuzzing of the real server with schemathesis: every response must match
/openapi.json (status code, content type, body schema, headers), no request may get a 5xx,
schema-invalid requests must be refused, and unsupported methods must get 405 with Allow.

A tiny random Llama (2 layers, width 64) with the default model's tokenizer and a 64-token
context keeps every generation short, so a few hundred requests take well under a minute.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from urllib.parse import urlsplit

import pytest

from tests.test_server import serve

pytestmark = pytest.mark.slow

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_headers_conformance,response_schema_conformance,negative_data_rejection,"
          "unsupported_method,allow_header_conformance")
EXAMPLES_PER_OPERATION = 80


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, default_gguf):
    config = tmp_path_factory.mktemp("tiny") / "tiny.json"
    config.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "max_position_embeddings": 256, "tie_word_embeddings": True,
    }))
    yield from serve(["--model", str(config), "--load-format", "dummy",
                      "--tokenizer", default_gguf, "--max-model-len", "64",
                      "--num-gpu-blocks-override", "32", "--swap-space", "0.01"])


def test_schemathesis_finds_nothing(tiny_server, tmp_path):
    har = tmp_path / "fuzz.har"
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", tiny_server.url + "/openapi.json",
         "--phases", "fuzzing", "--mode", "all", "--checks", CHECKS,
         "--max-examples", str(EXAMPLES_PER_OPERATION), "--seed", "13", "--workers", "1",
         "--request-timeout", "60", "--report", "har", "--report-har-path", str(har)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    entries = json.loads(har.read_text())["log"]["entries"]
    statuses = Counter(e["response"]["status"] for e in entries)
    print(f"schemathesis: {len(entries)} requests, status counts {dict(sorted(statuses.items()))}")
    assert len(entries) >= 250  # a few hundred requests, all of them answered
    assert not [s for s in statuses if s >= 500]
    assert statuses[200] and statuses[400]  # both valid and invalid requests were made
    # The Responses and Messages routes were fuzzed too, with requests that generated.
    for path in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
        answered = {e["response"]["status"] for e in entries
                    if urlsplit(e["request"]["url"]).path == path}
        assert {200, 400} <= answered, (path, answered)
