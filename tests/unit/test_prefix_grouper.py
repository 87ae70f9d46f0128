"""Shared-prefix packing (``actor.use_prefix_grouper``): the layout, the two-part attention of both packed
kernels, per-token log-probs, entropy, values and gradients equal to the plain layout's on random groups,
and the micro-batch plan that keeps a prompt's responses together."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM, LlamaForTokenClassification

from ppo import attention, packed_forward
from ppo.config import ConfigError
from ppo.packing import pack, plan_shared_micro_batches, prompt_groups, shared_tokens, unpack
from tests.helpers import tiny_config


def test_shared_layout_by_hand() -> None:
    """Two responses to [5 6 7] and one to [8]: the shared prompt without its last token once, then per
    response its last token and the response; the lone prompt is a plain sequence."""
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([5, 6, 7])]
    responses = torch.tensor([[1, 2, 0], [3, 4, 9], [10, 0, 0]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    p = pack(prompts, responses, mask, share_prompts=True)
    #                          shared  suffix 0   suffix 2  plain [8] + 3 4 9
    assert p.input_ids.tolist() == [5, 6, 7, 1, 2, 7, 10, 8, 3, 4, 9]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 0, 1, 2, 3]
    assert p.shared.groups == ((0, 2, 5, 7), (7, 7, 11))
    assert p.response_index.tolist() == [[2, 3, 0], [7, 8, 9], [5, 0, 0]]
    assert p.labels.tolist() == [-100, -100, 1, 2, -100, 10, -100, 3, 4, 9, -100]
    assert p.offsets == [0, 2, 5, 7, 11]
    assert unpack(torch.arange(11.0), p).tolist() == [[2.0, 3.0, 0.0], [7.0, 8.0, 9.0], [5.0, 0.0, 0.0]]
    # A prompt with one response: the plain sequence's tokens and positions, attention in two parts.
    single = pack(prompts[:2], responses[:2], mask[:2], share_prompts=True)
    assert single.input_ids.tolist() == [5, 6, 7, 1, 2, 8, 3, 4, 9]
    assert single.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert single.shared.groups == ((0, 2, 5), (5, 5, 9))
    assert prompt_groups(prompts) == [[0, 2], [1]]
    assert shared_tokens(3, [2, 1]) == 2 + 3 + 2 and shared_tokens(1, [3]) == 4


def test_shared_groups_must_tile_the_row() -> None:
    with pytest.raises(ValueError, match="does not continue"):
        attention.SharedPrefix(((0, 2, 5), (6, 6, 8)), "cpu")
    with pytest.raises(ValueError, match="does not continue"):
        attention.SharedPrefix(((0, 2, 2),), "cpu")  # an empty suffix


def random_groups(
    seed: int, sizes: list[int], width: int = 7
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Prompts of 1-9 tokens, each repeated ``sizes[g]`` times, with responses of 0-``width`` tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for size in sizes:
        prompt = torch.randint(3, 50, (int(torch.randint(1, 10, (), generator=g)),), generator=g)
        prompts += [prompt] * size
    responses = torch.randint(3, 50, (len(prompts), width), generator=g)
    lens = torch.randint(0, width + 1, (len(prompts),), generator=g)
    return prompts, responses, torch.arange(width)[None] < lens[:, None]


def models(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    config = tiny_config(vocab_size=50, attn_implementation=attention.PACKED_ATTENTION)
    actor = LlamaForCausalLM(config).eval()
    critic = LlamaForTokenClassification(
        tiny_config(vocab_size=50, num_labels=1, attn_implementation=attention.PACKED_ATTENTION)
    ).eval()
    return actor, critic


@pytest.mark.parametrize("sizes", [[1, 1, 1], [2, 1, 3], [4, 4], [16], [1, 16, 5]])
@pytest.mark.parametrize("fused", [False, True])
def test_logprobs_entropy_values_equal_plain(sizes: list[int], fused: bool) -> None:
    """Per-token log-probs, entropy (both kernels) and values of the shared layout equal the plain
    layout's within fp32 tolerance, on ragged prompts and responses (empty ones included)."""
    actor, critic = models()
    prompts, responses, mask = random_groups(sum(sizes), sizes)
    plain = pack(prompts, responses, mask)
    shared = pack(prompts, responses, mask, share_prompts=True)
    # Each group of G responses saves G - 1 copies of its prompt but its last token.
    saved = sum((len(g) - 1) * (prompts[g[0]].numel() - 1) for g in prompt_groups(prompts))
    assert shared.num_tokens == plain.num_tokens - saved
    with torch.no_grad():
        a = packed_forward.logprobs(actor, plain, temperature=0.7, compute_entropy=True, fused=fused)
        b = packed_forward.logprobs(actor, shared, temperature=0.7, compute_entropy=True, fused=fused)
        va, vb = packed_forward.values(critic, plain), packed_forward.values(critic, shared)
    for x, y in zip((*a, va), (*b, vb), strict=True):
        torch.testing.assert_close(x, y, atol=2e-6, rtol=0)
    assert (a[0][mask] != 0).all() and (a[0][~mask] == 0).all()


def test_a_row_does_not_depend_on_its_micro_batch() -> None:
    """A response's log-probs are the same bits alone, with some of its group, or with all of it, in any
    order: runs agree on any number of ranks and any token budget."""
    actor, _ = models()
    prompts, responses, mask = random_groups(6, [4])  # a 9-token prompt; responses of 5, 1, 4, 5 tokens

    def logprobs(rows: list[int]) -> torch.Tensor:
        packed = pack([prompts[i] for i in rows], responses[rows], mask[rows], share_prompts=True)
        with torch.no_grad():
            return packed_forward.logprobs(actor, packed, temperature=1.0)[0]

    alone = logprobs([0])[0]
    for rows in ([0, 1], [2, 0, 3], [1, 2, 3, 0]):
        assert torch.equal(logprobs(rows)[rows.index(0)], alone), rows


def test_gradients_equal_plain() -> None:
    """The same loss of log-probs and values gives the same parameter gradients: the shared tokens'
    gradient is the sum over their responses."""
    prompts, responses, mask = random_groups(3, [3, 1, 8])
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for share in (False, True):
        actor, critic = models()
        packed = pack(prompts, responses, mask, share_prompts=share)
        logprobs, entropy = packed_forward.logprobs(actor, packed, temperature=1.0, compute_entropy=True)
        values = packed_forward.values(critic, packed)
        loss = ((logprobs + 0.1 * entropy + values) * weights * mask).sum()
        loss.backward()
        grads.append(
            {n: p.grad for n, p in itertools.chain(actor.named_parameters(), critic.named_parameters())}
        )
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=2e-5, rtol=1e-4, msg=name)


def reference_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> torch.Tensor:
    """FlashAttention's varlen contract on the CPU: ``[T, H, d]`` tensors, causal aligned bottom-right
    (query ``t`` of ``l`` over ``n`` keys sees keys ``<= t + n - l``)."""
    assert window_size == (-1, 0)
    out = []
    for (qa, qb), (ka, kb) in zip(
        itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist()), strict=True
    ):
        assert qb - qa <= max_q and kb - ka <= max_k
        mask = torch.arange(kb - ka)[None, :] <= torch.arange(qb - qa)[:, None] + (kb - ka) - (qb - qa)
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[qa:qb].transpose(0, 1),
                k[ka:kb].transpose(0, 1),
                v[ka:kb].transpose(0, 1),
                attn_mask=mask,
                scale=scale,
                enable_gqa=enable_gqa,
            ).transpose(0, 1)
        )
    return torch.cat(out)


def test_varlen_flash_path_equals_sdpa_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path (one varlen call over gathered keys) computes what the sdpa path computes: checked
    on the CPU with a reference of the varlen kernel's contract in its place."""
    monkeypatch.setattr(attention, "_varlen_attn", lambda: reference_varlen)
    prompts, responses, mask = random_groups(5, [3, 1, 2, 1])
    layout = pack(prompts, responses, mask, share_prompts=True).shared
    tokens = layout.num_tokens
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, tokens, 8, generator=g)
    key, value = torch.randn(1, 2, tokens, 8, generator=g), torch.randn(1, 2, tokens, 8, generator=g)
    module = torch.nn.Module()
    kwargs: dict[str, Any] = {attention.SHARED_PREFIX: layout}
    sdpa, _ = attention.varlen_sdpa_attention(module, query, key, value, None, scaling=0.3, **kwargs)
    flash, _ = attention.varlen_flash_attention(module, query, key, value, None, scaling=0.3, **kwargs)
    torch.testing.assert_close(flash, sdpa, atol=1e-6, rtol=0)
    # And each token attends to exactly its own sequence: the sdpa path equals attention per sequence.
    for a, b, *ends in layout.groups:
        for s, e in itertools.pairwise([b, *ends]):
            keys = torch.cat([torch.arange(a, b), torch.arange(s, e)])
            seq_q = torch.cat([query[0][:, a:b], query[0][:, s:e]], dim=1)
            expected = torch.nn.functional.scaled_dot_product_attention(
                seq_q, key[0][:, keys], value[0][:, keys], is_causal=True, scale=0.3, enable_gqa=True
            )
            torch.testing.assert_close(sdpa[0, s:e], expected[:, b - a :].transpose(0, 1), atol=1e-6, rtol=0)


def test_shared_rows_need_the_packed_kernels() -> None:
    with pytest.raises(ConfigError, match="actor.use_prefix_grouper"):
        attention.resolve_attn_implementation("sdpa", "cpu", shared_prefix=True)
    assert (
        attention.resolve_attn_implementation("auto", "cpu", shared_prefix=True) == attention.PACKED_ATTENTION
    )


def test_plan_keeps_groups_together() -> None:
    """Fixed size: rows in group order; dynamic: a group per unit, cut where it exceeds the budget (the
    prompt repeated), units halved where the rank needs more micro-batches than it has units."""
    prompt_lens = [10, 4, 10, 4, 10, 10]
    response_lens = [5, 3, 5, 3, 5, 5]
    groups = [[0, 2, 4, 5], [1, 3]]
    fixed = dict(use_dynamic_bsz=False, max_tokens=0, micro_batch_size=4)
    assert plan_shared_micro_batches(prompt_lens, response_lens, groups, **fixed) == [[0, 2, 4, 5], [1, 3]]
    # Group 0 takes 9 + 4 * 6 = 33 tokens, group 1 3 + 2 * 4 = 11: one micro-batch of 44.
    dynamic = dict(use_dynamic_bsz=True, micro_batch_size=1)
    assert plan_shared_micro_batches(prompt_lens, response_lens, groups, max_tokens=44, **dynamic) == [
        [0, 1, 2, 3, 4, 5]
    ]
    # A budget of 30 cuts group 0 into 9 + 3 * 6 = 27 and 15 (its last row alone), then balances.
    assert plan_shared_micro_batches(prompt_lens, response_lens, groups, max_tokens=30, **dynamic) == [
        [0, 2, 4],
        [1, 3, 5],
    ]


def test_the_key_and_its_default() -> None:
    """``auto`` shares prompts wherever the packed kernels run; verl's spelling sets it; an explicit
    ``true`` with transformers' own attention is a one-line error naming both keys."""
    from ppo.config_loader import load_config

    assert load_config(None, []).share_prompts
    assert not load_config(None, ["rollout.n=1"]).share_prompts
    assert not load_config(None, ["model.attn_implementation=sdpa"]).share_prompts
    assert not load_config(None, ["actor_rollout_ref.actor.use_prefix_grouper=false"]).share_prompts
    cfg = load_config(None, ["actor_rollout_ref.actor.use_prefix_grouper=true"])
    assert cfg.actor.use_prefix_grouper is True and cfg.share_prompts
    with pytest.raises(
        ConfigError, match=r"model.attn_implementation=sdpa cannot run with actor.use_prefix_grouper"
    ):
        load_config(None, ["actor.use_prefix_grouper=true", "model.attn_implementation=sdpa"])
