"""Tests of ``data.apply_chat_template_kwargs`` (verl's key): the keywords reach the chat template of the
prompts (``ppo.data.load_prompts``), a keyword the template does not read is one warning naming it, and a
keyword the loader sets itself is an error.

The tokenizer is the tiny character-level one of ``scripts/make_tiny_assets.py`` with a template that
reads ``enable_thinking`` as Qwen3's does: ``enable_thinking=false`` writes an empty think block after the
generation prompt; absent or true, the model is left to think.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from ppo.chat_template import check_chat_template_kwargs, unused_chat_template_kwargs
from ppo.config import ConfigError
from ppo.data import load_prompts
from tests.helpers import load_script, train, write_parquet

THINKING_TEMPLATE = load_script("make_tiny_assets").CHAT_TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
)

PLAIN = "<s><|user|>23 + 48<|assistant|>"
NO_THINK = PLAIN + "<think>\n\n</think>\n\n"


@pytest.fixture
def thinking_tok(tok: Any) -> Any:
    """The tiny tokenizer with a chat template that reads ``enable_thinking``."""
    t = copy.deepcopy(tok)
    t.chat_template = THINKING_TEMPLATE
    return t


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    row = {
        "prompt": [{"role": "user", "content": "23 + 48"}],
        "data_source": "synthetic/arith",
        "reward_model": {"style": "rule", "ground_truth": "71"},
    }
    return write_parquet(tmp_path / "p.parquet", [row])


@pytest.mark.parametrize(
    "kwargs,text",
    [(None, PLAIN), ({"enable_thinking": True}, PLAIN), ({"enable_thinking": False}, NO_THINK)],
)
def test_keywords_reach_the_template(
    prompts: Path, thinking_tok: Any, kwargs: dict[str, Any] | None, text: str
) -> None:
    (rec,) = load_prompts(prompts, thinking_tok, max_prompt_length=64, chat_template_kwargs=kwargs)
    assert rec.prompt_text == text
    # The rendered text tokenized without special tokens: BOS once (the template's), one id per character.
    assert rec.input_ids == thinking_tok(text, add_special_tokens=False)["input_ids"]
    assert len(rec.input_ids) == 3 + len("23 + 48") + (
        len("<think>\n\n</think>\n\n") if text == NO_THINK else 0
    )


def test_unused_keyword_is_one_warning_naming_it(thinking_tok: Any, caplog: pytest.LogCaptureFixture) -> None:
    kwargs = {"enable_thinking": False, "enable_thinkng": False, "reasoning_effort": "low"}
    with caplog.at_level(logging.WARNING, logger="ppo"):
        check_chat_template_kwargs(thinking_tok, kwargs)
    assert [r.getMessage() for r in caplog.records] == [
        "data.apply_chat_template_kwargs.enable_thinkng (did you mean enable_thinking?), "
        "data.apply_chat_template_kwargs.reasoning_effort: the tokenizer's chat template does not read them, "
        "so they change nothing; it reads add_generation_prompt, bos_token, enable_thinking, eos_token, messages"
    ]


def test_keyword_at_its_default_value_counts_as_used(thinking_tok: Any, tok: Any) -> None:
    # enable_thinking=true renders exactly as without it, yet the template reads it: not unused.
    assert unused_chat_template_kwargs(thinking_tok, {"enable_thinking": True}) == []
    # apply_chat_template's own arguments are not template variables, and are used.
    assert unused_chat_template_kwargs(thinking_tok, {"continue_final_message": False}) == []
    # The plain template reads no enable_thinking.
    assert unused_chat_template_kwargs(tok, {"enable_thinking": False}) == ["enable_thinking"]


def test_no_template_rendering_warns(thinking_tok: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ppo"):
        check_chat_template_kwargs(thinking_tok, {"enable_thinking": False}, apply_chat_template=False)
    assert [r.getMessage() for r in caplog.records] == [
        "data.apply_chat_template_kwargs is set but data.apply_chat_template=false: enable_thinking changes nothing"
    ]


def test_a_keyword_the_loader_sets_is_an_error(prompts: Path, thinking_tok: Any) -> None:
    message = (
        "data.apply_chat_template_kwargs: tokenize is set by the trainer (chat messages in, text out, with "
        "the generation prompt): remove it"
    )
    with pytest.raises(ConfigError) as err:
        check_chat_template_kwargs(thinking_tok, {"tokenize": True})
    assert str(err.value) == message
    with pytest.raises(ConfigError) as err:
        load_prompts(prompts, thinking_tok, max_prompt_length=64, chat_template_kwargs={"tokenize": True})
    assert str(err.value) == message
    # An open assistant turn contradicts the generation prompt: it was transformers' raw ValueError.
    with pytest.raises(ConfigError) as err:
        load_prompts(
            prompts, thinking_tok, max_prompt_length=64, chat_template_kwargs={"continue_final_message": True}
        )
    assert str(err.value) == message.replace("tokenize", "continue_final_message")


@pytest.mark.slow
def test_a_run_renders_its_prompts_with_the_keywords(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """verl's line on ``train_ppo``: the two validation prompts logged at step 0 (loaded as the training
    ones are) end with the empty think block, and the keyword the template does not read is warned about
    once."""
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(tiny_assets / "tokenizer", tokenizer)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": THINKING_TEMPLATE})
    )
    (tokenizer / "chat_template.jinja").unlink(missing_ok=True)
    out = tmp_path / "run"
    train(
        tiny_assets,
        out,
        f"model.tokenizer_path={tokenizer}",
        "+data.apply_chat_template_kwargs.enable_thinking=False",
        "+data.apply_chat_template_kwargs.reasoning_effort=low",
        "trainer.log_val_generations=2",
        steps=1,
    )
    prompts = [json.loads(line)["prompt"] for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(prompts) == 2 and all(p.endswith("<|assistant|><think>\n\n</think>\n\n") for p in prompts)
    unused = [m for m in caplog.messages if "does not read" in m]
    assert unused == [
        "data.apply_chat_template_kwargs.reasoning_effort: the tokenizer's chat template does not read it, so it "
        "changes nothing; it reads add_generation_prompt, bos_token, enable_thinking, eos_token, messages"
    ]
