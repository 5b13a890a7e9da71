"""Priorities in the offline API: LLM.generate's priority list, as vLLM's (the scheduler's own order is
tests/engine/test_priority.py's)."""

from __future__ import annotations

import pytest


def test_offline_generate_takes_vllms_priority_list(llama_dir):
    """LLM.generate(..., priority=[...]), as vLLM's: with room for one request at a time, the high-priority
    prompt (0) is served before the low one (2) given ahead of it; a bad list is a ValueError."""
    from servelm import LLM, SamplingParams

    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    low, high = llm.generate([[1, 2, 3], [4, 5, 6]], params, use_tqdm=False, priority=[2, 0])
    assert high.metrics["first_token_time"] < low.metrics["first_token_time"]
    low, high = llm.generate([[1, 2, 3], [4, 5, 6]], params, use_tqdm=False)  # both normal: in order
    assert low.metrics["first_token_time"] < high.metrics["first_token_time"]
    for bad in ([0], [0, 3]):
        with pytest.raises(ValueError, match="priority"):
            llm.generate([[1, 2, 3], [4, 5, 6]], params, use_tqdm=False, priority=bad)
