"""The two wire shapes of vLLM's top logprobs, turned into [T, k] arrays and candidate
sets (workers/engines/vllm_top.py), on hand-written answers of vllm 0.32's format."""

from __future__ import annotations

import numpy as np
import pytest

from workers.engines.vllm_pool import VLLMError
from workers.engines.vllm_top import candidate_sets, completions_top, top_arrays


def test_generate_route_keeps_ranks_one_to_k_best_first() -> None:
    """The sampled token comes first with its own rank; one outside the top k (rank 7)
    is dropped, and the k best are ordered by logprob whatever their wire order."""
    steps = [[(42, -3.0, 7), (5, -0.5, 1), (9, -1.5, 2)],     # sampled 42 is rank 7
             [(9, -1.2, 2), (5, -0.7, 1)]]                    # sampled 9 is rank 2
    ids, lps = top_arrays(steps, 2)
    assert ids.tolist() == [[5, 9], [5, 9]]
    np.testing.assert_allclose(lps, [[-0.5, -1.5], [-0.7, -1.2]])
    assert ids.dtype == np.int32 and lps.dtype == np.float32


def test_clamped_minus_inf_is_no_candidate() -> None:
    """vLLM sends -inf (a token top-k removed) as -9999: it is absent (-1, -inf)."""
    ids, lps = top_arrays([[(5, -0.1, 1), (8, -2.4, 2), (3, -9999.0, 3)]], 3)
    assert ids.tolist() == [[5, 8, -1]]
    assert np.isneginf(lps[0, 2])


def test_completions_route_needs_token_id_keys() -> None:
    assert completions_top({"token_id:12": -0.2, "token_id:7": -1.9}) == [
        (12, -0.2, None), (7, -1.9, None)]
    assert completions_top(None) == []
    with pytest.raises(VLLMError, match="--return-tokens-as-token-ids"):
        completions_top({" the": -0.2})


def test_completions_route_keeps_the_k_highest() -> None:
    """Without ranks: the sampled token (first, maybe outside the top k) and the top k;
    the k highest logprobs are the top k."""
    entry = completions_top({"token_id:40": -4.0, "token_id:1": -0.3, "token_id:2": -1.0})
    ids, _ = top_arrays([entry], 2)
    assert ids.tolist() == [[1, 2]]


def test_candidate_sets_complete_or_unknown() -> None:
    ids = np.array([[4, 6, -1], [7, -1, -1]], dtype=np.int32)
    flat, counts = candidate_sets(ids, top_k=0)  # top-p only, every row shows its end
    assert flat.tolist() == [4, 6, 7] and counts.tolist() == [2, 1]
    full = np.array([[4, 6, 8], [7, -1, -1]], dtype=np.int32)
    assert candidate_sets(full, top_k=0) is None    # row 0 may go on past k
    assert candidate_sets(full, top_k=5) is None    # top-k 5 > k = 3: unknown
    flat, counts = candidate_sets(full, top_k=3)    # top-k 3 <= k: complete
    assert counts.tolist() == [3, 1]
