"""The rollout's prefill (``ppo.prefill``, through ``ppo.rollout.decode``): identical prompts of a
micro-batch are prefilled once and give the tokens of the plain path (greedy, and sampled with one seed),
rows in their order; a kept cache cropped where the next prompt leaves the cached tokens gives the tokens
of a fresh prefill; which decoders and paths keep plain ``generate``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

from ppo import prefill
from ppo.rollout import decode, generation_config
from tests.helpers import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

# Three prompts of 7, 12 and 4 tokens, each 4 times in a row (rollout.n = 4), then the first once more
# out of its group: 13 rows, 3 distinct prompts.
BASE = [[17, 5, 99, 23, 41, 8, 60], [3, 77, 12, 90, 34, 56, 78, 9, 11, 100, 45, 67], [88, 21, 7, 50]]
PROMPTS = [p for p in BASE for _ in range(4)] + [BASE[0]]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(pad_token_id=0), attn_implementation="sdpa").eval()


def forward_shapes(model: torch.nn.Module) -> tuple[list[tuple[int, int]], Any]:
    """The ``[rows, tokens]`` of every forward of ``model`` from now on, and the hook to remove."""
    shapes: list[tuple[int, int]] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    return shapes, hook


def config(do_sample: bool, new_tokens: int = 10) -> GenerationConfig:
    return generation_config(
        max_new_tokens=new_tokens, do_sample=do_sample, temperature=1.0, eos_token_ids=[2], pad_token_id=0
    )


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize(
    ("micro_batch_size", "prefills"),
    [
        # One micro-batch: the 3 distinct prompts, left-padded to the widest (12), all but the last token.
        (13, [(3, 11)]),
        # Rows 0-5 (prompt 0 x 4, prompt 1 x 2), 6-11 (prompt 1 x 2, prompt 2 x 4), 12 (prompt 0): the group
        # of prompt 1 straddles two micro-batches and is prefilled in each; row 12 alone repeats nothing
        # and is decoded by plain generate (its whole 7-token prompt prefilled in one forward).
        (6, [(2, 11), (2, 11), (1, 7)]),
    ],
)
def test_shared_prefill_gives_the_tokens_of_plain_generate(
    model: torch.nn.Module, do_sample: bool, micro_batch_size: int, prefills: list[tuple[int, int]]
) -> None:
    prompts = [torch.tensor(p) for p in PROMPTS]
    torch.manual_seed(7)
    plain = decode(model, prompts, config(do_sample), micro_batch_size=micro_batch_size, share_prefill=False)
    shapes, hook = forward_shapes(model)
    torch.manual_seed(7)  # the same draws: the decoding loop samples the same [B, V] rows in the same order
    shared = decode(model, prompts, config(do_sample), micro_batch_size=micro_batch_size)
    hook.remove()
    assert torch.equal(shared, plain)
    assert shared.shape == (13, 10) and not torch.equal(shared[0], shared[4])  # rows differ: order matters
    if do_sample:  # the 4 copies of a prompt drew different responses
        assert len({tuple(r) for r in shared[:4].tolist()}) > 1
    # Each micro-batch: one forward of its distinct prompts, then one-token forwards of all its rows.
    assert [s for s in shapes if s[1] > 1] == prefills
    assert {s[0] for s in shapes if s[1] == 1} == {
        min(micro_batch_size, 13 - i) for i in range(0, 13, micro_batch_size)
    }


def test_a_kept_cache_cropped_by_the_next_prompt_gives_a_fresh_prefills_tokens(
    model: torch.nn.Module,
) -> None:
    """The multi-turn case: the next call's prompt keeps 3 of the 9 generated tokens the cache holds (the
    10th is never fed back) and appends 4 new ones (a stop-string cut, then an observation); the row
    reuses its cache for the prompt and those 3 tokens, and its tokens equal a plain call's."""
    rows = PROMPTS[:8]
    first, cached = prefill.generate_with_cache(model, rows, config(False), keep=True)
    assert [len(c.tokens) - c.input_len for c in cached] == [9] * 8  # all but the last of 10 generated
    nxt = [p + first[j, :3].tolist() + [31, 32, 33, 34] for j, p in enumerate(rows)]
    kept = prefill.KeptCaches(fresh=cached)
    kept.start_call()
    past = kept.match(nxt)
    assert [c.row for c in past] == list(range(8))
    shapes, hook = forward_shapes(model)
    got, _ = prefill.generate_with_cache(model, nxt, config(False), past=past, keep=True)
    hook.remove()
    # Each row prefills only its 4 new tokens but the last: one [8, 3] forward, then one-token forwards.
    assert shapes[0] == (8, 3) and all(s == (8, 1) for s in shapes[1:])
    plain = decode(
        model, [torch.tensor(p) for p in nxt], config(False), micro_batch_size=8, share_prefill=False
    )
    assert torch.equal(got, plain)
    # A prompt that does not start with a kept row's input reuses nothing; rows 4-7 share their input
    # (prompt 1), so a prompt extending it takes the next of them in order, the one after the next.
    kept = prefill.KeptCaches(fresh=cached)
    kept.start_call()
    assert kept.match([[1, 2, 3], nxt[5], nxt[7], nxt[0]]) == [None, cached[4], cached[5], None]
    assert kept.rows[:6] == [None] * 6 and kept.rows[6:] == cached[6:]  # passed rows are released


def test_decoders_without_a_plain_dynamic_cache_keep_plain_generate(model: torch.nn.Module) -> None:
    assert prefill.reusable(model)
    sliding = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=2, vocab_size=128, use_sliding_window=True, sliding_window=4,
                          max_window_layers=0)  # fmt: skip
    assert not prefill.reusable(AutoModelForCausalLM.from_config(sliding))
    assert not prefill.reusable(torch.nn.Linear(2, 2))


def test_fixed_shapes_keep_plain_generate(model: torch.nn.Module) -> None:
    """The compiled engine's path (padded to ``micro_batch_size`` rows and prompts to 64 tokens): one
    prefill forward of every (padded) row's whole prompt, as before."""
    shapes, hook = forward_shapes(model)
    decode(
        model, [torch.tensor(p) for p in PROMPTS[:4]], config(False, 3), micro_batch_size=6, fixed_shapes=True
    )
    hook.remove()
    assert shapes == [(6, 64), (6, 1), (6, 1)]
