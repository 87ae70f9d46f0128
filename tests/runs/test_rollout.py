"""The compiled rollout (``rollout.compile``): a persistent copy of the actor with a static KV cache and a
compiled decoding step gives the greedy tokens of the plain path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppo import rollout
from ppo.build import build
from ppo.config_loader import load_config
from tests.helpers import base_args


def test_left_pad_to_a_bucket() -> None:
    ids, mask = rollout.left_pad(
        [torch.tensor([5, 6, 7]), torch.tensor([8])], 0, torch.device("cpu"), multiple_of=4
    )
    assert ids.tolist() == [[0, 5, 6, 7], [0, 0, 0, 8]]
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]


@pytest.mark.slow
def test_compiled_rollout_gives_the_plain_greedy_tokens(tiny_assets: Path, tmp_path: Path, one_rank) -> None:
    args = base_args(tiny_assets, tmp_path / "plain") + ["data.max_response_length=16"]
    plain_cfg = load_config(None, args)
    compiled_cfg = load_config(
        None, [*args, f"trainer.output_dir={tmp_path / 'compiled'}", "rollout.compile=true"]
    )
    plain = build(plain_cfg, one_rank)
    compiled = build(compiled_cfg, one_rank)
    assert plain.sampler.engine is None and compiled.sampler.engine is not None
    records = plain.loader.records[:6]  # one micro-batch, padded to 64 rows by the engine
    expected = rollout.sample(plain.sampler, records, do_sample=False)
    for _ in range(2):  # the second call reuses the compiled step and the refreshed weights
        got = rollout.sample(compiled.sampler, records, do_sample=False)
        assert torch.equal(got.responses, expected.responses)
        assert torch.equal(got.attention_mask, expected.attention_mask)
    # The engine decodes with the actor's current weights: change them and the tokens follow.
    with torch.no_grad():
        for p_plain, p_compiled in zip(
            plain.actor.model.parameters(), compiled.actor.model.parameters(), strict=True
        ):
            p_plain.mul_(1.5)
            p_compiled.mul_(1.5)
    expected = rollout.sample(plain.sampler, records, do_sample=False)
    got = rollout.sample(compiled.sampler, records, do_sample=False)
    assert torch.equal(got.responses, expected.responses)
