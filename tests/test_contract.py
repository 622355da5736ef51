"""The step contract (pagedllm/contract.py) is plain data: importing it loads no torch, and
a StepResult reads its samples back from the sampler's packed rows by name."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

from pagedllm.contract import SampleResult, SpecStats, StepResult


def test_the_contract_imports_no_torch():
    code = "import sys, pagedllm.contract; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_step_result_unpacks_ids_logprobs_and_top_alternatives():
    # Two steps; rows: seq 7 (one sample, 2 top logprobs), seq 9 (two samples, none).
    packed = np.zeros((2, 3, 3 + 2 * 2))
    packed[0] = [[11, -0.5, 1, 11, 4, -0.5, -1.5],
                 [20, -1.0, 2, 0, 0, 0, 0],
                 [21, -2.0, 3, 0, 0, 0, 0]]
    packed[1, :, :3] = [[12, -0.25, 1], [22, -0.75, 1], [23, -0.125, 1]]
    result = StepResult(seq_ids=[7, 9], num_samples=[1, 2], num_logprobs=[2, 0])
    result.set_packed(packed)
    assert result.num_steps == 2 and result.token_ids.dtype == np.int64
    assert result.token_ids.tolist() == [[11, 20, 21], [12, 22, 23]]
    steps = result.samples()
    assert steps[0][7] == [SampleResult(11, -0.5, 1, {11: -0.5, 4: -1.5})]
    assert steps[0][9] == [SampleResult(20, -1.0, 2, {}), SampleResult(21, -2.0, 3, {})]
    assert [s.token_id for s in steps[1][9]] == [22, 23]
    assert StepResult().samples() == [] and StepResult().num_steps == 0


def test_spec_stats_count_by_name():
    stats = SpecStats()
    stats.record(num_proposed=4, num_accepted=3)
    stats.record(num_proposed=2, num_accepted=0)
    assert (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_verified_rows) == \
        (6, 3, 2)
