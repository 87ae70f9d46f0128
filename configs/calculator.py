"""A calculator tool for multi-turn rollouts (configs/demo_cpu_tools.yaml): a worked example of the
environment interface.

The model writes ``<calc>47+38</calc>``; the turn ends at the stop string ``</calc>``; the trainer calls
``step`` with the turn's text and appends the observation ``<result>85</result>`` to the trajectory; the
model continues (``\\n#### 85`` and EOS). Observation tokens are not trained. The outcome reward still comes
from ``reward.*`` (here the rule score of the ``#### N`` line); ``step`` gives no reward of its own.

Use it with::

    rollout:
      multi_turn:
        enable: true
        env: configs/calculator.py:Calculator
        stop: ["</calc>"]

One instance serves one trajectory: ``reset`` gets the prompt's Parquet record (``ground_truth`` and
``extra_info`` included) and may return text to append to the prompt; ``step`` gets the text of the turn
that just ended and returns ``(observation, reward, done)``. Both run in the training process, so they
must be quick and must not touch torch.distributed.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

CALL = re.compile(r"<calc>(.*?)</calc>\s*$", re.DOTALL)
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_CALLS = 4


def evaluate(expression: str) -> int:
    """The value of an integer expression with ``+``, ``-``, ``*``, unary minus and parentheses; ValueError
    for anything else (names, calls, division, powers, more than 64 characters)."""
    if len(expression) > 64:
        raise ValueError("expression too long")

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError("not an expression") from e
    return value(tree.body)


class Calculator:
    """Answers the turn's last ``<calc>EXPR</calc>`` with ``<result>VALUE</result>`` (or
    ``<result>error</result>``); after ``MAX_CALLS`` calls the trajectory ends."""

    def reset(self, row: dict[str, Any]) -> None:
        self.calls = 0

    def step(self, action_text: str) -> tuple[str, float, bool]:
        self.calls += 1
        match = CALL.search(action_text)
        try:
            result = str(evaluate(match.group(1))) if match else "error"
        except ValueError:
            result = "error"
        return f"<result>{result}</result>", 0.0, self.calls >= MAX_CALLS
