"""The step's fixed costs around the arithmetic (``docs/cpu_step_profile.md``): ``models.evaluating`` leaves
a model in eval untouched and switches a training one without re-kernelizing it, ``packing.pack_rows``
packs a selection of rows once per step (equal to ``pack``), ``micro_batches`` plans from the step's
lengths, ``optimize`` counts an epoch's mini-batches at once (its metrics derived by hand), and
``ppo_bench.overhead_floor --profile`` lists the project's functions."""

from __future__ import annotations

import cProfile
from typing import Any

import pytest
import torch
from ppo_bench.overhead_floor import profile_rows
from torch import nn

from ppo import ulysses
from ppo.batch import Batch, Rollout, group_index
from ppo.config import ActorConfig
from ppo.data import PromptRecord
from ppo.metrics import extreme_part, ratio_parts
from ppo.models import evaluating
from ppo.optim import Trained
from ppo.optimize import global_counts, global_counts_of, optimize
from ppo.packing import (
    balanced_partition,
    micro_batches,
    pack,
    pack_rows,
    plan_micro_batches,
    plan_shared_micro_batches,
    prompt_groups,
    unpack,
)
from tests.helpers import tiny_config
from tests.unit.test_prefix_grouper import random_groups

pytestmark = pytest.mark.usefixtures("one_thread")


class CountingTrain(nn.Sequential):
    """A module that counts the calls of its ``train`` (``eval`` calls it too)."""

    calls = 0

    def train(self, mode: bool = True) -> CountingTrain:
        type(self).calls += 1
        return super().train(mode)


def counting_model() -> CountingTrain:
    CountingTrain.calls = 0
    return CountingTrain(nn.Linear(4, 4), nn.Dropout(0.5), CountingTrain(nn.Linear(4, 4)))


def test_evaluating_leaves_a_model_in_eval_untouched() -> None:
    model = counting_model().eval()
    CountingTrain.calls = 0
    with evaluating(model) as inside:
        assert inside is model and not any(m.training for m in model.modules())
    assert CountingTrain.calls == 0  # nothing walked the modules to set a mode
    assert not any(m.training for m in model.modules())
    # A body that switches the model to training leaves it in eval, as a switch and back did.
    with evaluating(model):
        model.train()
    assert not any(m.training for m in model.modules())


def test_evaluating_switches_a_training_model_and_restores_it() -> None:
    model = counting_model().train()
    x = torch.randn(3, 4)
    with evaluating(model):
        assert not any(m.training for m in model.modules())
        assert torch.equal(model(x), model(x))  # dropout off: deterministic
    assert all(m.training for m in model.modules())
    with pytest.raises(RuntimeError), evaluating(model):
        raise RuntimeError("restored on the way out too")
    assert all(m.training for m in model.modules())
    # A model in eval at the root with one submodule left training: eval inside, the root's mode after
    # (as model.eval() then model.train(False) left it).
    model.eval()
    model[2].train()
    with evaluating(model):
        assert not any(m.training for m in model.modules())
    assert not any(m.training for m in model.modules())


def test_evaluating_does_not_rekernelize_a_training_transformers_model(tmp_path: Any) -> None:
    """transformers' ``PreTrainedModel.train`` re-kernelizes a model loaded with Hugging Face ``kernels``
    (the default where the package is installed, as with transformers 5.25) at each change of mode;
    ``evaluating`` switches the modules' modes only, and the outputs are those of ``model.eval()``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config(attention_dropout=0.5)).save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path).train()
    mode = getattr(model, "kernels_mode", None)
    calls = []
    set_use_kernels = model.set_use_kernels
    model.set_use_kernels = lambda *a, **k: calls.append(a) or set_use_kernels(*a, **k)
    ids = torch.randint(3, 50, (2, 7))
    with torch.no_grad(), evaluating(model):
        assert not any(m.training for m in model.modules())
        ours = model(ids).logits
    assert all(m.training for m in model.modules())
    assert calls == [] and getattr(model, "kernels_mode", None) == mode
    with torch.no_grad():
        reference = model.eval()(ids).logits
    assert torch.equal(ours, reference)


def make_batch(seed: int, sizes: list[int], *, share_prompts: bool) -> Batch:
    prompts, responses, mask = random_groups(seed, sizes)
    rollout = Rollout(
        prompts=prompts,
        responses=responses,
        attention_mask=mask,
        truncated=torch.zeros(len(prompts), dtype=torch.bool),
    )
    records = [
        PromptRecord(
            input_ids=p.tolist(), prompt_text="", data_source="t", ground_truth=None, extra_info={}, index=i
        )
        for i, p in enumerate(prompts)
    ]
    return Batch(
        rollout=rollout,
        records=records,
        group_ids=group_index(len(prompts), 1, torch.device("cpu")),
        share_prompts=share_prompts,
    )


def assert_same_packed(a: Any, b: Any) -> None:
    for name in ("input_ids", "position_ids", "cu_seqlens", "labels", "response_index", "attention_mask"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.offsets == b.offsets
    assert (a.shared is None and b.shared is None) or a.shared.groups == b.shared.groups


@pytest.mark.parametrize("share_prompts", [False, True])
def test_pack_rows_equals_pack_of_the_rows(share_prompts: bool) -> None:
    """Ragged prompts and responses (some empty), groups of 1-4 identical prompts, random selections in
    random orders: the packed row is ``pack``'s, field for field (the plain one gathered from the whole
    batch packed once, the shared one where a selection repeats a prompt)."""
    for seed in range(8):
        batch = make_batch(seed, [1, 3, 2, 1, 4], share_prompts=share_prompts)
        r = batch.rollout
        gen = torch.Generator().manual_seed(seed)
        for _ in range(6):
            num = int(torch.randint(1, len(r.prompts) + 1, (), generator=gen))
            sel = torch.randperm(len(r.prompts), generator=gen)[:num]
            expected = pack(
                [r.prompts[i] for i in sel.tolist()],
                r.responses[sel],
                r.attention_mask[sel],
                share_prompts=share_prompts,
            )
            assert_same_packed(pack_rows(batch, sel), expected)


def test_pack_rows_is_built_once_per_selection() -> None:
    batch = make_batch(0, [2, 1, 3], share_prompts=False)
    first = pack_rows(batch, torch.tensor([0, 3, 5]))
    assert pack_rows(batch, torch.tensor([0, 3, 5])) is first  # the same rows: the same Packed
    r = batch.rollout
    for rows in ([0, 3, 4], [5, 3, 0]):  # other rows, the same rows in another order: another row
        other = pack_rows(batch, torch.tensor(rows))
        assert other is not first
        assert_same_packed(
            other, pack([r.prompts[i] for i in rows], r.responses[rows], r.attention_mask[rows])
        )
    # share_prompts is part of the key: rows 0 and 1 answer the same prompt.
    plain = pack_rows(batch, torch.tensor([0, 1]))
    batch.share_prompts = True
    shared = pack_rows(batch, torch.tensor([0, 1]))
    assert plain.shared is None and shared.shared is not None
    assert shared.input_ids.numel() == plain.input_ids.numel() - (batch.rollout.prompts[0].numel() - 1)
    # A batch given another rollout packs that one.
    prompts, responses, mask = random_groups(1, [2, 1, 3])
    batch.rollout = Rollout(prompts=prompts, responses=responses, attention_mask=mask, truncated=mask[:, 0])
    batch.share_prompts = False
    again = pack_rows(batch, torch.tensor([0, 3, 5]))
    assert_same_packed(again, pack([prompts[i] for i in (0, 3, 5)], responses[[0, 3, 5]], mask[[0, 3, 5]]))
    with pytest.raises(ValueError, match="empty"):
        pack_rows(batch, torch.tensor([], dtype=torch.long))


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
def test_micro_batches_plan_from_the_batch(share_prompts: bool, dynamic: bool) -> None:
    """The plan of ``plan_micro_batches`` (``plan_shared_micro_batches``) on the selection's lengths."""
    batch = make_batch(3, [1, 3, 2, 1, 4], share_prompts=share_prompts)
    role = ActorConfig(use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=24, ppo_micro_batch_size_per_gpu=3)
    plan = {"use_dynamic_bsz": dynamic, "max_tokens": 24, "micro_batch_size": 3}
    idx = torch.randperm(11, generator=torch.Generator().manual_seed(0))[:9]
    rows = idx.tolist()
    prompts = [batch.rollout.prompts[i] for i in rows]
    response_lens = batch.attention_mask[idx].sum(-1).tolist()
    if share_prompts:
        groups = plan_shared_micro_batches(
            [p.numel() for p in prompts], response_lens, prompt_groups(prompts), **plan
        )
    else:
        groups = plan_micro_batches([batch.seq_lens[i] for i in rows], **plan)
    got = micro_batches(batch, idx, role)
    assert [sel.tolist() for sel in got] == [[rows[i] for i in g] for g in groups]
    assert len(got) > 1


def test_global_counts_of_an_epoch_equal_each_mini_batch_counted_alone(one_rank: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(12, 9, generator=gen) < 0.4
    mask[3] = False  # an empty response: not a sequence
    minis = [torch.tensor([0, 3, 5]), torch.tensor([1, 2, 4, 6]), torch.tensor([3])]
    got = global_counts_of([mask[i] for i in minis])
    assert got == [global_counts(mask[i]) for i in minis]
    # Row 3 alone: no token; the counts stay at least 1 (no division by zero).
    assert got[2] == {"num_tokens": 1.0, "num_seqs": 1.0}
    assert got[0]["num_tokens"] == float(mask[[0, 3, 5]].sum())
    assert got[0]["num_seqs"] == float(mask[[0, 5]].any(-1).sum())


def test_optimize_metrics(one_rank: Any) -> None:
    """Two epochs of two shuffled mini-batches of 8 rows, each cut into micro-batches by a token budget;
    every row has 4 response tokens (ragged prompts), so every mini-batch counts 32 tokens and 8 rows. The
    closure's value of a token is its id times a weight ``w = 1`` that SGD with rate 0 keeps, so every
    metric is derived from the batch's tokens:

    - ``toy/mean`` (summed micro-batch shares ``sum / num_tokens``): each mini-batch's mean; two halves
      of 32 tokens per epoch, so the mean over the 4 updates is the batch's mean token;
    - ``toy/odd`` (a ratio): the mean of the odd tokens over every update, so over the batch;
    - ``toy/low#min`` and ``toy/high#max``: the batch's smallest and largest token;
    - ``grad_norm``: the loss's gradient in ``w`` is the mini-batch's mean, so the mean of the norms is
      the batch's mean token again."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    rows, width = 16, 6
    prompts = [
        torch.randint(3, 90, (int(n),), generator=gen) for n in torch.randint(1, 6, (rows,), generator=gen)
    ]
    responses = torch.randint(3, 90, (rows, width), generator=gen)
    mask = torch.arange(width)[None].expand(rows, width) < 4
    rollout = Rollout(prompts=prompts, responses=responses, attention_mask=mask, truncated=mask[:, -1])
    batch = Batch(
        rollout=rollout,
        records=[None] * rows,  # only counted
        group_ids=group_index(rows, 1, torch.device("cpu")),
    )
    weight = nn.Parameter(torch.ones(()))
    model = nn.Module()
    model.weight = weight
    optimizer = torch.optim.SGD([weight], lr=0.0)
    trained = Trained(
        model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.ConstantLR(optimizer)
    )
    seen: list[tuple[int, dict[str, float]]] = []

    def loss_fn(sel: torch.Tensor, counts: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        seen.append((len(sel), counts))
        packed = pack_rows(batch, sel)
        tokens = unpack(packed.labels.float(), packed) * weight  # [B, R]: the response tokens, times w
        m = batch.response_mask[sel]
        loss = (tokens * m).sum() / counts["num_tokens"]
        odd = m & (responses[sel] % 2 == 1)
        parts = {"toy/mean": loss, **ratio_parts("toy/odd", (tokens * odd).sum(), odd.sum().float())}
        parts |= extreme_part("toy/low", tokens.masked_fill(~m, float("inf")).min(), "min")
        parts |= extreme_part("toy/high", tokens.masked_fill(~m, float("-inf")).max(), "max")
        return loss, parts

    role = ActorConfig(ppo_epochs=2, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=40, grad_clip=0.0)
    out = optimize(role, "toy", trained, batch, loss_fn, num_mini=2, shuffle=True, sp=ulysses.NO_SP)

    trained_tokens = responses[mask].double()
    mean = trained_tokens.mean().item()
    odd = trained_tokens[trained_tokens % 2 == 1]
    assert out["toy/mean"] == pytest.approx(mean, rel=1e-6)
    assert out["toy/odd"] == pytest.approx(odd.mean().item(), rel=1e-6)
    assert out["toy/low"] == trained_tokens.min().item() and out["toy/high"] == trained_tokens.max().item()
    assert out["toy/grad_norm"] == pytest.approx(mean, rel=1e-6)
    assert out["toy/num_updates"] == 4.0 and out["toy/skipped_updates"] == 0.0
    assert set(out) == {
        "toy/mean",
        "toy/odd",
        "toy/low",
        "toy/high",
        "toy/grad_norm",
        "toy/num_updates",
        "toy/skipped_updates",
    }
    # Every micro-batch saw its mini-batch's counts; the budget cut each mini-batch in two or more.
    assert all(c == {"num_tokens": 32.0, "num_seqs": 8.0} for _, c in seen)
    assert len(seen) > 4 and sum(n for n, _ in seen) == 2 * rows


def test_profile_rows_name_the_projects_functions() -> None:
    """``overhead_floor --profile``'s rows: the project's functions only, per step."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(4):
        balanced_partition([5, 3, 2, 1], 2)
    sorted([3, 1, 2])  # not the project's
    profiler.disable()
    rows = profile_rows(profiler, steps=2, top=50)
    assert all(r.function.startswith(("ppo/", "ppo_kernels/", "train_ppo.py")) for r in rows)
    (row,) = [r for r in rows if r.function.endswith("(balanced_partition)")]
    assert row.function.startswith("ppo/packing.py:")
    assert row.calls_per_step == 2.0 and row.cumulative_ms >= row.own_ms >= 0.0
