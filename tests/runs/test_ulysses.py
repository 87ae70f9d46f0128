"""Tests of ppo.ulysses: Ulysses sequence parallelism (SP) of packed forwards.

The SP checks run this file as a gloo worker under ``torch.distributed.run`` (2 ranks, SP = 2, FSDP over
the same 2 ranks; see ``_worker`` at the bottom) and compare every result with one process running the
whole packed row on an unsharded copy of the model::

    pytest tests/runs/test_ulysses.py        # about 35 s on 2 cores, most of it the 2-rank worker
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

from ppo import packed_forward, packing, ulysses
from ppo.attention import PACKED_ATTENTION, ULYSSES, packed_kwargs, resolve_attn_implementation
from ppo.packing import Packed
from tests.helpers import (
    GRAD_RTOL,
    VOCAB,
    Checks,
    assert_check,
    grad_rel_diff,
    max_diff,
    tiny_config,
    worker_results,
)


def make_packed(prompt_lens: list[int], response_lens: list[int], seed: int) -> Packed:
    """A PPO row (``ppo.packing.pack``) of random prompts and right-padded responses."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in prompt_lens]
    width = max(response_lens)
    responses = torch.randint(3, VOCAB, (len(response_lens), width), generator=gen)
    mask = torch.arange(width)[None, :] < torch.tensor(response_lens)[:, None]
    return packing.pack(prompts, torch.where(mask, responses, torch.zeros_like(responses)), mask)


# Row A: sequences of 5, 9, 6 tokens (T = 20, slices of 10): a boundary inside each slice.
ROW_A = dict(prompt_lens=[3, 4, 2], response_lens=[2, 5, 4], seed=1)
# Row B: 4 + 9 = 13 tokens, padded to 14: slice 1 (tokens 7-13) starts inside the second sequence
# and ends with the padding.
ROW_B = dict(prompt_lens=[2, 3], response_lens=[2, 6], seed=2)


def fake_group(size: int, rank: int) -> ulysses.SPGroup:
    """A group for the host-side bookkeeping only (no collective runs on it)."""
    return ulysses.SPGroup(size=size, rank=rank, first_rank=0, group=None)


# ----------------------------------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------------------------------


def test_slice_for_rank_pads_and_keeps_positions_and_labels() -> None:
    packed = make_packed(**ROW_B)
    assert packed.num_tokens == 13 and packed.offsets == [0, 4, 13]
    slices = [ulysses.slice_for_rank(packed, fake_group(2, r)) for r in range(2)]
    assert [(s.start, s.stop) for s in slices] == [(0, 7), (7, 14)]
    ids = torch.cat([s.input_ids for s in slices])
    pos = torch.cat([s.position_ids for s in slices])
    labels = torch.cat([s.labels for s in slices])
    # The 13 tokens as they were, then one padding token: id 0, a sequence of its own (position 0),
    # label -100. Slice 1 starts inside sequence 2 with its own position, 3 (= 7 - 4).
    assert torch.equal(ids[:13], packed.input_ids) and ids[13] == 0
    assert pos.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0]
    assert slices[1].position_ids[0] == 3
    assert torch.equal(labels[:13], packed.labels) and labels[13] == -100
    # The attention sees the padded row's offsets: the padding is a sequence of its own.
    assert slices[0].context.attention_kwargs["ppo_packed_offsets"] == (0, 4, 13, 14)
    assert slices[0].context.local_tokens == 7
    assert slices[0].layout == [0, 4, 13]


def unpack_local(
    sl: ulysses.SPSlice, x_local: torch.Tensor, packed: Packed
) -> tuple[torch.Tensor, torch.Tensor]:
    """A slice's per-token ``x_local [T_local]`` in the response layout, and which entries this rank
    holds: ``([B, R], owned [B, R] bool)``, 0 where not owned. Each valid response token is owned by
    exactly one rank of the group, so a masked loss summed over ranks counts it once (the trainer
    gathers whole rows instead; a loss on local tokens is checked against it below)."""
    owned = packed.attention_mask & (packed.response_index >= sl.start) & (packed.response_index < sl.stop)
    local_index = (packed.response_index - sl.start).clamp(0, x_local.shape[0] - 1)
    out = x_local[local_index]
    return torch.where(owned, out, torch.zeros_like(out)), owned


def test_unpack_local_owned_masks_partition_the_response_tokens() -> None:
    packed = make_packed(**ROW_A)
    owned = []
    for r in range(2):
        sl = ulysses.slice_for_rank(packed, fake_group(2, r))
        x = torch.arange(sl.start, sl.stop, dtype=torch.float32)  # the packed position of each token
        values, mask = unpack_local(sl, x, packed)
        # Where owned, the value is the packed position the response token is predicted at.
        assert torch.equal(values[mask], packed.response_index[mask].float())
        assert not values[~mask].any()
        owned.append(mask)
    # Every valid response token owned by exactly one rank; both ranks own some (responses straddle).
    assert torch.equal(owned[0] ^ owned[1], packed.attention_mask)
    assert not (owned[0] & owned[1]).any() and owned[0].any() and owned[1].any()


def test_sp_size_one_is_a_no_op() -> None:
    assert ulysses.make_sp_groups(1) is ulysses.NO_SP  # no process group needed
    x = torch.randn(3, 4, requires_grad=True)
    assert ulysses.gather_tokens(x, ulysses.NO_SP) is x
    assert ulysses.gather_seq_scatter_heads(x, sp=ulysses.NO_SP) == (x,)
    packed = make_packed(**ROW_B)
    sl = ulysses.slice_for_rank(packed, ulysses.NO_SP)
    assert sl.context is None and torch.equal(sl.input_ids, packed.input_ids) and sl.stop == 13
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(attn_implementation=PACKED_ATTENTION))
    with torch.no_grad():
        got, _ = packed_forward.logprobs(model, packed, ulysses.NO_SP, temperature=0.7)
        # Each sequence alone through the plain model: the packed row without SP gives its log-probs.
        expected = torch.zeros_like(got)
        for b in range(len(packed.offsets) - 1):
            start, stop = packed.offsets[b], packed.offsets[b + 1]
            logits = model(packed.input_ids[None, start:stop]).logits[0].float() / 0.7
            at = packed.response_index[b][packed.attention_mask[b]] - start  # predicts response token j
            labels = packed.labels[packed.response_index[b][packed.attention_mask[b]]]
            expected[b, : at.numel()] = logits.log_softmax(-1)[at, labels]
    assert packed.attention_mask.sum() == 8 and max_diff(got, expected) < 1e-5


def test_check_heads_names_the_numbers() -> None:
    config = tiny_config(num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    config._attn_implementation = PACKED_ATTENTION
    with pytest.raises(ValueError, match=r"actor.ulysses_sequence_parallel_size=4 must divide .*=6"):
        ulysses.check_heads(config, 4, "actor.ulysses_sequence_parallel_size")
    # 3 divides 6 query heads; the 2 key/value heads are repeated (to lcm(2, 3) = 6).
    ulysses.check_heads(config, 3, "actor.ulysses_sequence_parallel_size")
    ulysses.check_heads(config, 1, "actor.ulysses_sequence_parallel_size")
    config._attn_implementation = "sdpa"
    with pytest.raises(
        ValueError, match=r"critic.ulysses_sequence_parallel_size=2 needs .*attends with sdpa"
    ):
        ulysses.check_heads(config, 2, "critic.ulysses_sequence_parallel_size")


def test_sequence_parallel_attention_choice() -> None:
    assert resolve_attn_implementation("auto", "cpu", sequence_parallel=True) == PACKED_ATTENTION
    assert resolve_attn_implementation(PACKED_ATTENTION, "cpu", sequence_parallel=True) == PACKED_ATTENTION
    for name in ("sdpa", "eager", "flash_attention_2"):
        with pytest.raises(ValueError, match=f"attn_implementation={name} cannot run with ulysses"):
            resolve_attn_implementation(name, "cpu", sequence_parallel=True)


def test_sp_forward_refuses_transformers_own_attention() -> None:
    # transformers' sdpa would ignore the SP kwarg and attend within the slice: a silent wrong answer.
    model = LlamaForCausalLM(tiny_config(attn_implementation="sdpa"))
    sl = ulysses.slice_for_rank(make_packed(**ROW_A), fake_group(2, 0))
    with pytest.raises(ValueError, match="sequence parallelism needs ppo_varlen_sdpa"):
        packed_forward.part_logprobs(model, sl, temperature=1.0)


# ----------------------------------------------------------------------------------------------------
# Two gloo ranks, SP = 2 (this file is the worker; see _worker below)
# ----------------------------------------------------------------------------------------------------

DIST_CHECKS = [
    "all_to_all_forward",
    "all_to_all_backward",
    "gather_tokens_forward_backward",
    "gather_rows_objects_broadcast",
    "attention_gqa",
    "attention_kv_repeated",
    "logprobs_row_a",
    "logprobs_row_b",
    "fused_logprobs_row_a",
    "fused_logprobs_row_b",
    "grads_gathered_row_a",
    "grads_gathered_row_b",
    "grads_fused_row_b",
    "grads_local_loss_row_a",
    "grads_checkpointed_row_b",
    "values_row_b",
    "value_grads_row_b",
    "kv_repeat_model_logprobs",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``_worker`` on 2 gloo ranks under torchrun, with a 60 s process-group timeout."""
    root = tmp_path_factory.mktemp("ulysses")
    for name, kv_heads in (("model", 2), ("mqa", 1)):  # saved here: the ranks would race to write
        torch.manual_seed(0)
        LlamaForCausalLM(tiny_config(num_key_value_heads=kv_heads)).save_pretrained(root / name)
    out = root / "results.json"
    return worker_results(__file__, root, out, out=out)


@pytest.mark.slow
@pytest.mark.parametrize("check", DIST_CHECKS)
def test_two_ranks(results: dict[str, Any], check: str) -> None:
    assert_check(results, check)


class _Causal(nn.Module):
    is_causal = True


def _worker(root: Path, out: Path) -> None:
    """SP = 2 over both ranks; each result against one process running the whole row. Both ranks
    record every check (their verdicts combined with a min), rank 0 writes them."""
    import torch.distributed as dist

    from ppo.attention import varlen_sdpa_attention
    from ppo.config import FSDPConfig
    from ppo.distributed import init_distributed, make_mesh
    from ppo.model_loading import load_causal_lm, load_critic
    from ppo.models import enable_gradient_checkpointing
    from ppo.sharding import shard_model

    info = init_distributed(device="cpu", timeout_s=60)
    rank = info.rank
    checks = Checks(out, info.is_main, agree=True)  # the same verdict on both ranks
    record, within = checks.record, checks.within

    sp = ulysses.make_sp_groups(2)
    assert sp.size == 2 and sp.rank == rank and ulysses.make_sp_groups(2) is sp  # cached
    gen = torch.Generator().manual_seed(0)  # the same global tensors on both ranks
    mine = slice(rank * 6, (rank + 1) * 6)  # this rank's 6 of T = 12 tokens

    with checks:  # an exception becomes the _error check; the process group ends here
        # 1. All-to-all: q, k, v with 4 and 2 heads in one exchange; then the way back.
        q, k = torch.randn(1, 4, 12, 8, generator=gen), torch.randn(1, 2, 12, 8, generator=gen)
        q_local, k_local = q[:, :, mine].clone().requires_grad_(), k[:, :, mine].clone().requires_grad_()
        q_heads, k_heads = ulysses.gather_seq_scatter_heads(q_local, k_local, sp=sp)
        # Rank r: every token of query heads 2r, 2r+1 and of key/value head r.
        expected_q, expected_k = q[:, 2 * rank : 2 * rank + 2], k[:, rank : rank + 1]
        back = ulysses.gather_heads_scatter_seq(q_heads.transpose(1, 2), sp)  # [1, 6, 4, 8]
        within(
            "all_to_all_forward",
            max(
                max_diff(q_heads, expected_q),
                max_diff(k_heads, expected_k),
                max_diff(back, q_local.transpose(1, 2)),
            ),
            0.0,
        )
        # Adjoint: with loss_r = <out_r, G_r> summed over ranks = <q, G_q> + <k, G_k>, the gradient of
        # each rank's input slice is its slice of G.
        gq, gk = torch.randn(1, 4, 12, 8, generator=gen), torch.randn(1, 2, 12, 8, generator=gen)
        gb = torch.randn(1, 12, 4, 8, generator=gen)
        loss = (q_heads * gq[:, 2 * rank : 2 * rank + 2]).sum() + (k_heads * gk[:, rank : rank + 1]).sum()
        loss = loss + (back * gb[:, mine]).sum()
        loss.backward()
        # back = the identity on q_local, so q's gradient also gets gb's slice.
        expected_gq = gq[:, :, mine] + gb[:, mine].transpose(1, 2)
        within(
            "all_to_all_backward",
            max(max_diff(q_local.grad, expected_gq), max_diff(k_local.grad, gk[:, :, mine])),
            1e-6,
        )

        # 2. gather_tokens: forward concatenates; backward sums the ranks' gradients (the adjoint).
        x = torch.randn(12, 3, generator=gen)
        g = torch.randn(2, 12, 3, generator=gen)  # rank r's loss: <gathered, g[r]>
        x_local = x[mine].clone().requires_grad_()
        gathered = ulysses.gather_tokens(x_local, sp)
        (gathered * g[rank]).sum().backward()
        diff = max(max_diff(gathered, x), max_diff(x_local.grad, g.sum(0)[mine]))
        within("gather_tokens_forward_backward", diff, 1e-6)

        # 3. Data helpers: rows padded to the group's widest, objects, a broadcast from rank 0.
        rows = torch.full((2, 3 + rank), rank + 1)  # rank 0: [2, 3] of 1s; rank 1: [2, 4] of 2s
        stacked = ulysses.all_gather_rows(rows, sp, pad_value=-1)
        expected_rows = torch.tensor([[1, 1, 1, -1]] * 2 + [[2, 2, 2, 2]] * 2)
        shuffle = ulysses.broadcast(torch.randperm(10), sp)
        shuffles = ulysses.all_gather_rows(shuffle[None], sp)
        record(
            "gather_rows_objects_broadcast",
            torch.equal(stacked, expected_rows)
            and ulysses.all_gather_object({"rank": rank}, sp) == [{"rank": 0}, {"rank": 1}]
            and torch.equal(shuffles[0], shuffles[1]),
            f"rows {stacked.tolist()}, shuffles {shuffles.tolist()}",
        )

        # 4. The packed attention kernel, SP against the whole row: 3 sequences, boundaries at 5 and 9.
        offsets = [0, 5, 9, 12]
        for name, kv_heads in (("attention_gqa", 2), ("attention_kv_repeated", 1)):
            q = torch.randn(1, 4, 12, 8, generator=gen)
            k, v = torch.randn(2, 1, kv_heads, 12, 8, generator=gen)
            g = torch.randn(1, 12, 4, 8, generator=gen)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref_out, _ = varlen_sdpa_attention(_Causal(), *leaves, None, **packed_kwargs(offsets, "cpu"))
            (ref_out * g).sum().backward()
            local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            context = ulysses.UlyssesContext(sp, 6, packed_kwargs(offsets, "cpu"))
            out_local, _ = varlen_sdpa_attention(_Causal(), *local, None, **{ULYSSES: context})
            (out_local * g[:, mine]).sum().backward()
            diff = max(
                max_diff(out_local, ref_out[:, mine]),
                *(max_diff(a.grad, b.grad[:, :, mine]) for a, b in zip(local, leaves, strict=True)),
            )
            within(name, diff, 1e-5)

        # 5. The model: log-probs and entropy of whole PPO rows, logits and fused LM-head paths.
        path = str(root / "model")
        ref = load_causal_lm(path).train()
        mesh = make_mesh(info)
        model = shard_model(load_causal_lm(path), mesh, FSDPConfig(), device="cpu").train()
        rows = {"row_a": make_packed(**ROW_A), "row_b": make_packed(**ROW_B)}
        tau = 0.7
        with torch.no_grad():
            for fused in (False, True):
                for row, packed in rows.items():
                    lp_ref, ent_ref = packed_forward.logprobs(
                        ref, packed, temperature=tau, compute_entropy=True
                    )
                    lp, ent = packed_forward.logprobs(
                        model, packed, sp, temperature=tau, compute_entropy=True, fused=fused
                    )
                    name = f"{'fused_' if fused else ''}logprobs_{row}"
                    within(name, max(max_diff(lp, lp_ref), max_diff(ent, ent_ref)), 1e-5)

        # 6. Gradients. The trainer's loss on each rank of the group: the gathered [B, R] quantities,
        # normalized by token counts summed over all ranks, which hold the group's sequences twice:
        # each rank's loss is half the row's, and FSDP sums the ranks' gradients.
        def ppo_like_loss(
            packed: Packed, lp: torch.Tensor, ent: torch.Tensor, num_tokens: float
        ) -> torch.Tensor:
            weights = torch.linspace(-1.0, 1.0, lp.numel()).reshape(lp.shape)  # stands in for advantages
            mask = packed.attention_mask
            return (torch.where(mask, lp * weights + 0.1 * ent, 0.0)).sum() / num_tokens

        def reference_backward(packed: Packed) -> float:
            """Zero both models' gradients, backward of the loss on the whole row through ``ref``; the
            row's number of response tokens."""
            count = float(packed.attention_mask.sum())
            ref.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            lp, ent = packed_forward.logprobs(ref, packed, temperature=tau, compute_entropy=True)
            ppo_like_loss(packed, lp, ent, count).backward()
            return count

        for row, fused, name in (
            ("row_a", False, "grads_gathered_row_a"),
            ("row_b", False, "grads_gathered_row_b"),
            ("row_b", True, "grads_fused_row_b"),
        ):
            packed = rows[row]
            count = reference_backward(packed)
            lp, ent = packed_forward.logprobs(
                model, packed, sp, temperature=tau, compute_entropy=True, fused=fused
            )
            ppo_like_loss(packed, lp, ent, sp.size * count).backward()  # count summed over both ranks
            within(name, grad_rel_diff(model, ref), GRAD_RTOL)

        # The other way: a loss on this rank's own tokens only, by the true count (each token once).
        packed = rows["row_a"]
        count = reference_backward(packed)
        sl = ulysses.slice_for_rank(packed, sp)
        lp_local, ent_local = packed_forward.part_logprobs(model, sl, temperature=tau, compute_entropy=True)
        lp, owned = unpack_local(sl, lp_local, packed)
        ent, _ = unpack_local(sl, ent_local, packed)
        local_packed = Packed(**{**vars(packed), "attention_mask": owned})
        ppo_like_loss(local_packed, lp, ent, count).backward()
        within("grads_local_loss_row_a", grad_rel_diff(model, ref), GRAD_RTOL)

        # Activation checkpointing (what long responses run with): the backward recomputes each layer's
        # forward, all-to-alls included, in the same order on both ranks.
        enable_gradient_checkpointing(model)
        packed = rows["row_b"]
        count = reference_backward(packed)
        lp, ent = packed_forward.logprobs(model, packed, sp, temperature=tau, compute_entropy=True)
        ppo_like_loss(packed, lp, ent, sp.size * count).backward()
        within("grads_checkpointed_row_b", grad_rel_diff(model, ref), GRAD_RTOL)

        # 7. Critic values, an unsharded replica on each rank: gradients all-reduced by hand.
        critic_ref = load_critic(path).train()
        with torch.no_grad():
            critic_ref.score.weight.normal_(generator=torch.Generator().manual_seed(1))
        critic = load_critic(path).train()
        critic.load_state_dict(critic_ref.state_dict())
        packed = rows["row_b"]
        values_ref = packed_forward.values(critic_ref, packed)
        values = packed_forward.values(critic, packed, sp)
        within("values_row_b", max_diff(values, values_ref), 1e-5)
        returns = torch.linspace(0.0, 1.0, values.numel()).reshape(values.shape)
        count = float(packed.attention_mask.sum())

        def value_loss(v: torch.Tensor, num_tokens: float) -> torch.Tensor:
            return torch.where(packed.attention_mask, (v - returns) ** 2, 0.0).sum() / num_tokens

        value_loss(values_ref, count).backward()
        value_loss(values, sp.size * count).backward()
        for p in critic.parameters():
            dist.all_reduce(p.grad)
        within("value_grads_row_b", grad_rel_diff(critic, critic_ref), GRAD_RTOL)

        # 8. One key/value head for two ranks: repeated before the exchange, through the whole model.
        mqa_ref = load_causal_lm(str(root / "mqa"))
        mqa = shard_model(load_causal_lm(str(root / "mqa")), mesh, FSDPConfig(), device="cpu")
        with torch.no_grad():
            lp_ref, _ = packed_forward.logprobs(mqa_ref, rows["row_a"], temperature=1.0)
            lp, _ = packed_forward.logprobs(mqa, rows["row_a"], sp, temperature=1.0)
        within("kv_repeat_model_logprobs", max_diff(lp, lp_ref), 1e-5)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))
