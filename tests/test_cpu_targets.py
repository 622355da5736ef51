"""`bench cpu`'s llama.cpp peer (where llama-cpp-python is installed): every stream's next
token in one llama_batch per llama_decode, greedy."""
from __future__ import annotations

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from pagedllm.benchmarks import cpu_targets  # noqa: E402
from pagedllm.loader import default_model_path  # noqa: E402


def spied(peer: cpu_targets.LlamaCppBatched) -> list[tuple[int, list[int]]]:
    """Each llama_decode call's batch size and picked tokens, as the peer runs."""
    calls, decode = [], peer._decode

    def spy(entries):
        picked = decode(entries)
        calls.append((len(entries), picked))
        return picked

    peer._decode = spy
    return calls


def test_batched_peer_decodes_one_token_of_every_stream_per_call():
    path = default_model_path()
    peer = cpu_targets.LlamaCppBatched(path, 1, max_seqs=3, ctx_per_seq=64)
    calls = spied(peer)
    prompts = [[1000 + 7 * i + s for i in range(8)] for s in range(3)]
    count, seconds = peer.run(prompts, 6)
    assert count == 3 * 6 and seconds > 0
    # the three prompts in one batch (one logits row each), then 3 tokens a call
    assert [n for n, _ in calls] == [24] + [3] * 5
    assert all(len(picked) == 3 for _, picked in calls)


def test_one_stream_is_llama_cpps_own_greedy_decode():
    path = default_model_path()
    model = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=1, verbose=False)
    prompt = model.tokenize(b"The capital of France is", add_bos=False)
    want = []
    for token in model.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        want.append(token)
        if len(want) == 8:
            break
    peer = cpu_targets.LlamaCppBatched(path, 1, max_seqs=1, ctx_per_seq=64)
    calls = spied(peer)
    peer.run([prompt], 8)
    assert [picked[0] for _, picked in calls] == want
