"""The keywords of the chat template (``data.apply_chat_template_kwargs``, verl's key), checked once
before the prompts load: a keyword the loaders set themselves is a ConfigError; one the template does not
read is a warning naming it (read from the template's source: ``template_variables``). ``ppo.data``
renders the prompts with them."""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ppo.config import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("ppo")

CHAT_TEMPLATE_KWARGS_KEY = "data.apply_chat_template_kwargs"

OWN_KEYWORDS = ("conversation", "add_generation_prompt", "tokenize", "continue_final_message")
"""Arguments of ``apply_chat_template`` the loaders set themselves (messages in, text out, the generation
prompt of an RL prompt): a user's value for one would be given twice. ``continue_final_message`` (an open
assistant turn to complete) contradicts the generation prompt, and transformers refuses the two together."""


def check_own_keywords(kwargs: Mapping[str, Any]) -> None:
    """ConfigError naming each keyword of ``kwargs`` that the loaders set themselves (``OWN_KEYWORDS``)."""
    own = [k for k in kwargs if k in OWN_KEYWORDS]
    if own:
        raise ConfigError(
            f"{CHAT_TEMPLATE_KWARGS_KEY}: {', '.join(own)} is set by the trainer (chat messages in, text out, "
            f"with the generation prompt): remove it"
        )


def template_variables(tokenizer: PreTrainedTokenizerBase, kwargs: Mapping[str, Any]) -> frozenset[str]:
    """The names the chat template ``apply_chat_template`` would use here reads from its context (jinja2's
    ``find_undeclared_variables`` over the template as transformers compiles it): ``messages``,
    ``add_generation_prompt``, and every keyword it honours, such as Qwen3's ``enable_thinking``."""
    import jinja2.meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    source = tokenizer.get_chat_template(kwargs.get("chat_template"), kwargs.get("tools"))
    parsed = _compile_jinja_template(source).environment.parse(source)
    return frozenset(jinja2.meta.find_undeclared_variables(parsed))


def unused_chat_template_kwargs(tokenizer: PreTrainedTokenizerBase, kwargs: Mapping[str, Any]) -> list[str]:
    """The keywords of ``kwargs`` that change nothing: neither an argument of ``apply_chat_template``
    itself (``tools``, ``chat_template``, ``continue_final_message``) nor a name the template reads
    (``template_variables``). Read from the template's source, not by rendering with and without each
    keyword, so a keyword given at its default value (``enable_thinking: true`` for Qwen3) still counts
    as used."""
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters)
    read = template_variables(tokenizer, kwargs)
    return [k for k in kwargs if k not in own and k not in read]


def check_chat_template_kwargs(
    tokenizer: PreTrainedTokenizerBase, kwargs: Mapping[str, Any], *, apply_chat_template: bool = True
) -> None:
    """Check ``data.apply_chat_template_kwargs`` once, before the prompts load: a keyword the loaders set
    themselves is a ConfigError; keywords that would change nothing are one warning naming each of them
    (those the chat template does not read, with the closest name it does read; all of them when no
    template renders the prompts)."""
    if not kwargs:
        return
    check_own_keywords(kwargs)
    if not apply_chat_template or getattr(tokenizer, "chat_template", None) is None:
        why = (
            "data.apply_chat_template=false"
            if not apply_chat_template
            else "the tokenizer has no chat template"
        )
        verb = "changes" if len(kwargs) == 1 else "change"
        logger.warning(
            "%s is set but %s: %s %s nothing", CHAT_TEMPLATE_KWARGS_KEY, why, ", ".join(kwargs), verb
        )
        return
    unused = unused_chat_template_kwargs(tokenizer, kwargs)
    if not unused:
        return
    read = sorted(template_variables(tokenizer, kwargs))
    named = []
    for k in unused:
        close = difflib.get_close_matches(k, read, n=1)
        named.append(f"{CHAT_TEMPLATE_KWARGS_KEY}.{k}" + (f" (did you mean {close[0]}?)" if close else ""))
    logger.warning(
        "%s: the tokenizer's chat template does not read %s, so %s nothing; it reads %s",
        ", ".join(named),
        "it" if len(unused) == 1 else "them",
        "it changes" if len(unused) == 1 else "they change",
        ", ".join(read),
    )
