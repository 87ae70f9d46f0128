"""Packing: layout, packed log-probs equal padded ones, balanced token-budget micro-batches;
rollout's response mask."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from ppo import packed_forward
from ppo.packing import (
    balanced_partition,
    min_micro_batches,
    pack,
    plan_micro_batches,
    unpack,
)
from ppo.rollout import attention_mask_from_eos, left_pad
from tests.helpers import tiny_config


def test_pack_layout() -> None:
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8])]
    responses = torch.tensor([[1, 2, 0], [3, 4, 9]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    p = pack(prompts, responses, mask)
    # seq 0 = 5 6 7 1 2 (prompt 3 + 2 valid response tokens), seq 1 = 8 3 4 9
    assert p.input_ids.tolist() == [5, 6, 7, 1, 2, 8, 3, 4, 9]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert p.cu_seqlens.tolist() == [0, 5, 9] and p.cu_seqlens.dtype == torch.int32
    # Response token j of seq i is predicted at start_i + P_i - 1 + j: seq 0 -> 2, 3; seq 1 -> 5, 6, 7.
    assert p.response_index.tolist() == [[2, 3, 0], [5, 6, 7]]
    assert p.labels.tolist() == [-100, -100, 1, 2, -100, 3, 4, 9, -100]
    got = unpack(torch.arange(9.0), p)
    assert got.tolist() == [[2.0, 3.0, 0.0], [5.0, 6.0, 7.0]]


def test_packed_logprobs_equal_padded() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(vocab_size=50, attn_implementation="sdpa")).eval()
    prompts = [torch.randint(3, 50, (n,)) for n in (4, 7, 2)]
    responses = torch.randint(3, 50, (3, 6))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        packed, _ = packed_forward.logprobs(
            model, pack(prompts, responses, mask), temperature=0.7, backend="torch"
        )
        # Reference: each sequence alone, padded on the right, full log_softmax.
        for i, prompt in enumerate(prompts):
            n = int(mask[i].sum())
            seq = torch.cat([prompt, responses[i, :n]])
            logits = model(seq[None]).logits[0].float() / 0.7
            logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(seq) - 1]
            expected = logp.gather(-1, responses[i, :n, None])[:, 0]
            torch.testing.assert_close(packed[i, :n], expected, atol=1e-5, rtol=0)
            assert (packed[i, n:] == 0).all()


def test_balanced_partition_is_balanced_and_complete() -> None:
    lengths = [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
    groups = balanced_partition(lengths, 3)
    assert sorted(i for g in groups for i in g) == list(range(10))
    totals = sorted(sum(lengths[i] for i in g) for g in groups)
    # Longest first into the lightest group (ties to the lower index): 10->A, 9->B, 8->C, 7->C=15,
    # 6->B=15, 5->A=15, 4->A=19, 3->B=18, 2->C=17, 1->C=18: totals 19, 18, 18.
    assert totals == [18, 18, 19]
    assert groups == sorted(groups, key=lambda g: g[0])


def test_min_micro_batches_respects_budget() -> None:
    # 4 x 30 tokens with a 64-token budget: two per group -> 2 groups.
    assert min_micro_batches([30, 30, 30, 30], 64) == 2
    # A single sequence over the budget still gets a group of its own.
    assert min_micro_batches([100, 10], 64) == 2
    assert min_micro_batches([5, 5], 64) == 1


def test_plan_micro_batches_fixed_and_dynamic() -> None:
    assert plan_micro_batches([1] * 5, use_dynamic_bsz=False, max_tokens=0, micro_batch_size=2) == [
        [0, 1],
        [2, 3],
        [4],
    ]
    groups = plan_micro_batches([40, 30, 20, 10], use_dynamic_bsz=True, max_tokens=50, micro_batch_size=0)
    # 100 tokens, budget 50 -> 2 groups of 50: {40, 10} and {30, 20}.
    assert groups == [[0, 3], [1, 2]]


def test_response_mask_stops_after_first_eos() -> None:
    eos = 2
    responses = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0]])
    mask, truncated = attention_mask_from_eos(responses, [eos])
    assert mask.tolist() == [[True, True, False, False], [True] * 4, [True, False, False, False]]
    assert truncated.tolist() == [False, True, False]  # the second never ended: clipped
    mask, truncated = attention_mask_from_eos(responses, [eos], ignore_eos=True)
    assert mask.all() and truncated.all()


def test_left_pad() -> None:
    ids, attn = left_pad(
        [torch.tensor([1, 2, 3]), torch.tensor([4])], pad_token_id=0, device=torch.device("cpu")
    )
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert attn.tolist() == [[1, 1, 1], [0, 0, 1]]
