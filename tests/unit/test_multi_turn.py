"""Multi-turn rollouts: the turn loop with a scripted model and stub environments (exact token layout,
both masks, step rewards on the turn's last generated token, timeouts, errors); the trainer over them (no
gradient reaches an observation token, rewards and GAE across an observation span by hand); end to end
on 1 rank, 2 ranks and SP with uneven turns, across a kill -9, and the calculator example."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from ppo import algorithms, batch_advantages, ulysses
from ppo.batch import Batch, Rollout, group_index
from ppo.config import RolloutConfig
from ppo.config_loader import load_config
from ppo.data import PromptRecord
from ppo.environments import EnvError, load_environment
from ppo.multi_turn import MultiTurn
from ppo.optimize import actor_loss, global_counts
from ppo.packing import pack_rows
from ppo.rollout import Sampler, sample
from tests.helpers import (
    REWARD_FNS,
    ROOT,
    base_args,
    deterministic,
    excerpt,
    hf_weights,
    read_metrics,
    run,
    tiny_config,
    torchrun,
    wait_until,
    waiting_env,
    write_parquet,
)
from tests.reward_fns import EVERY_CHARACTER

EOS, PAD = 2, 0


class Scripted(torch.nn.Module):
    """A "model" whose ``generate`` writes the next of ``turns`` (texts) for each row: the turn loop
    without sampling. Turn ``k`` of every row is ``turns[k]``."""

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer, self.turns, self.calls = tokenizer, turns, 0
        self.generation_config = GenerationConfig()

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generation_config: Any, **_: Any
    ) -> torch.Tensor:
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        if text.endswith("#"):  # a final turn (marked by a trailing "#"): the answer, then EOS
            ids = self.tokenizer.encode(text[:-1], add_special_tokens=False) + [EOS]
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        ids = ids[: generation_config.max_new_tokens]
        new = torch.tensor([ids] * input_ids.shape[0])
        return torch.cat([input_ids, new], dim=1)


class Calc:
    """Answers ``<calc>a+b</calc>`` with ``<result>s</result>`` (reward 0.5 per call), never done."""

    def reset(self, row: dict) -> None:
        self.row = row

    def step(self, action: str) -> tuple[str, float, bool]:
        expr = action.split("<calc>")[-1].split("</calc>")[0]
        a, b = expr.split("+")
        return f"<result>{int(a) + int(b)}</result>", 0.5, False


def settings(tok: Any, env: type, **over: Any) -> MultiTurn:
    values = dict(env_class=env, tokenizer=tok, max_turns=4, max_tool_response_length=32, step_timeout_s=5.0,
                  stop=["</calc>"], max_response_length=64)  # fmt: skip
    return MultiTurn(**{**values, **over})


def records(tok: Any, n: int = 2) -> list[PromptRecord]:
    ids = tok.encode("47 + 38", add_special_tokens=False)
    return [PromptRecord(input_ids=ids, prompt_text="47 + 38", data_source="synthetic/arith", ground_truth="85",
                         extra_info={}, index=i) for i in range(n)]  # fmt: skip


def run_turns(model: torch.nn.Module, recs: list[PromptRecord], turns: MultiTurn) -> tuple[Rollout, dict]:
    """The trainer's entry (``rollout.sample`` with a multi-turn sampler), greedy; the rollout and the sums
    of its per-row counts."""
    sampler = Sampler(actor=model, engine=None, settings=RolloutConfig(), eos_ids=[EOS], pad_token_id=PAD,
                      max_response_length=turns.max_response_length, multi_turn=turns)  # fmt: skip
    rollout = sample(sampler, recs, do_sample=False, micro_batch_size=8)
    return rollout, {k: v.sum().item() for k, v in rollout.turn_stats.items()}


def test_a_tool_call_trajectory_is_the_tokens_in_order_with_two_masks(tok: Any) -> None:
    turn1, turn2 = "47+38=<calc>47+38</calc>", "85\n#### 85#"
    model = Scripted(tok, [turn1, turn2])
    rollout, counts = run_turns(model, records(tok), settings(tok, Calc))
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    observation = enc("<result>85</result>")
    expected = enc(turn1) + observation + enc(turn2[:-1]) + [EOS]
    n = len(expected)
    for row in range(2):
        assert rollout.responses[row, :n].tolist() == expected
        assert rollout.attention_mask[row].tolist() == [True] * n + [False] * (64 - n)
        # The loss mask is 1 exactly on the generated tokens: turn 1, then turn 2 with its EOS.
        gen = [True] * len(enc(turn1)) + [False] * len(observation) + [True] * (len(enc(turn2[:-1])) + 1)
        assert rollout.response_mask[row, :n].tolist() == gen and not rollout.response_mask[row, n:].any()
        # The step's reward sits on the last generated token of turn 1 (the ">" closing </calc>).
        assert rollout.env_rewards[row].nonzero().flatten().tolist() == [len(enc(turn1)) - 1]
        assert rollout.env_rewards[row, len(enc(turn1)) - 1].item() == 0.5
    assert not rollout.truncated.any()
    assert counts == {"step_timeouts": 0.0, "observation_truncations": 0.0, "turns": 4.0, "tool_calls": 2.0}


def test_the_response_budget_counts_observations_and_turns_stop_at_the_cap(tok: Any) -> None:
    # Every turn calls the tool: 3 turns at most, each "<calc>1+1</calc>" (16 tokens) + "<result>2</result>" (18).
    model = Scripted(tok, ["<calc>1+1</calc>"])
    rollout, counts = run_turns(
        model, records(tok, 1), settings(tok, Calc, max_turns=3, max_response_length=120)
    )
    assert counts["turns"] == 3.0 and counts["tool_calls"] == 3.0
    assert rollout.attention_mask.sum().item() == 3 * (16 + 18)
    assert rollout.response_mask.sum().item() == 3 * 16 and bool(
        rollout.truncated[0]
    )  # never ended with an EOS
    # A budget of 40 tokens: turn 1 (16), its observation (18), 6 tokens of turn 2, then the budget ends it.
    rollout, counts = run_turns(
        Scripted(tok, ["<calc>1+1</calc>"]), records(tok, 1), settings(tok, Calc, max_response_length=40)
    )
    assert rollout.attention_mask.sum().item() == 40 and rollout.response_mask.sum().item() == 16 + 6
    assert counts["turns"] == 2.0


class Wrong(Calc):
    def step(self, action: str) -> Any:
        return "ok", "high", False


class Raises(Calc):
    def step(self, action: str) -> Any:
        raise KeyError("no such tool")


def test_a_step_that_overruns_ends_the_trajectory_with_reward_0_and_is_counted(tok: Any) -> None:
    """The step has not returned when the rollout comes back: the turn loop gave up on it rather than
    waiting (it would have scored its reward 1 and gone on to a second turn)."""
    calls: list[str] = []
    release = threading.Event()
    try:
        rollout, counts = run_turns(
            Scripted(tok, ["<calc>1+1</calc>"]),
            records(tok, 1),
            settings(tok, waiting_env(Calc, calls, release, done=False), step_timeout_s=0.5),
        )
        assert "end" not in calls
    finally:
        release.set()  # the abandoned call ends
    assert counts["step_timeouts"] == 1.0 and counts["turns"] == 1.0
    assert not rollout.env_rewards.any() and rollout.attention_mask.sum().item() == 16


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (Wrong, r"Wrong.step returned \('ok', 'high', False\); expected"),
        (Raises, r"Raises.step raised KeyError: 'no such tool'"),
    ],
)
def test_a_step_that_breaks_the_contract_is_one_clear_error(tok: Any, env: type, message: str) -> None:
    with pytest.raises(EnvError, match=message):
        run_turns(Scripted(tok, ["<calc>1+1</calc>"]), records(tok, 1), settings(tok, env))


def test_a_bad_environment_path_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "envs.py"
    path.write_text(
        "class Calc:\n    def reset(self, row):\n        return None\n    def step(self, text):\n        return '', 0.0, True\n"
        "\nclass NoStep:\n    def reset(self, row):\n        return None\n"
    )
    assert load_environment(f"{path}:Calc").__name__ == "Calc"
    with pytest.raises(
        EnvError, match=r"rollout.multi_turn.env='.*:NoStep' must be a class with reset\(row\) and step"
    ):
        load_environment(f"{path}:NoStep")
    with pytest.raises(Exception, match=r"rollout.multi_turn.env='.*:Calcs'.*has no attribute 'Calcs'"):
        load_environment(f"{path}:Calcs")


class Uneven(Calc):
    """Row ``i``'s trajectory takes ``1 + i % 3`` tool calls, the last one done; call ``k`` answers
    ``" ok"`` ``1 + (i + k) % 3`` times (3 to 9 tokens), reward 0.5."""

    def reset(self, row: dict) -> None:
        self.index, self.calls = row["index"], 0

    def step(self, action: str) -> tuple[str, float, bool]:
        self.calls += 1
        return " ok" * (1 + (self.index + self.calls) % 3), 0.5, self.calls >= 1 + self.index % 3


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("micro_batch_size", "do_sample"), [(8, False), (3, False), (3, True)])
def test_kept_caches_give_the_tokens_of_re_prefilling(
    tok: Any, micro_batch_size: int, do_sample: bool
) -> None:
    """A random tiny Llama, 8 rows (4 prompts, two of them the same, twice), turns that end at "a", "e" or "o"
    (some after many tokens, while other rows that stopped early decode on: their caches hold tokens the
    trajectories cut), an EOS or the budget, observations of 3 to 9 tokens: the rollout with each row's
    cache kept from turn to turn (and shared prompts prefilled once) equals the one that re-prefills
    every trajectory every turn, token for token; 3 rows a micro-batch regroups rows of different caches
    every turn. Sampled with one seed, the draws are the same too. The weights are drawn 10x wider than
    a checkpoint's (initializer range 0.2) so that a token's attention to its context decides it: with
    the default range the greedy tokens barely depend on the cache (a cache not cropped at the stop
    string went unnoticed)."""
    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(tok), pad_token_id=PAD, initializer_range=0.2)
    model = AutoModelForCausalLM.from_config(config).eval()
    texts = ["47 + 38", "12 + 5", "47 + 38", "9+9"] * 2
    recs = [PromptRecord(input_ids=tok.encode(t, add_special_tokens=False), prompt_text=t, data_source="s",
                         ground_truth="0", extra_info={}, index=i) for i, t in enumerate(texts)]  # fmt: skip
    turns = settings(
        tok, Uneven, stop=["a", "e", "o"], max_turns=4, max_tool_response_length=16, max_response_length=48
    )
    sampler = Sampler(actor=model, engine=None, settings=RolloutConfig(), eos_ids=[EOS], pad_token_id=PAD,
                      max_response_length=48, multi_turn=turns)  # fmt: skip
    prefilled: dict[bool, int] = {}
    rollouts: dict[bool, Rollout] = {}
    for keep in (True, False):
        shapes: list[tuple[int, int]] = []
        hook = model.register_forward_pre_hook(
            lambda _m, _a, kwargs, seen=shapes: seen.append(tuple(kwargs["input_ids"].shape)),
            with_kwargs=True,
        )
        torch.manual_seed(3)
        rollouts[keep] = sample(sampler, recs, do_sample=do_sample, micro_batch_size=micro_batch_size,
                                keep_cache=keep, share_prefill=keep)  # fmt: skip
        hook.remove()
        prefilled[keep] = sum(rows * width for rows, width in shapes if width > 1)
    kept, again = rollouts[True], rollouts[False]
    for name in ("responses", "attention_mask", "response_mask", "env_rewards", "truncated"):
        assert torch.equal(getattr(kept, name), getattr(again, name)), name
    if not do_sample:  # rows that end after 1, 2 and 3 turns
        assert set(kept.turn_stats["turns"].tolist()) == {1.0, 2.0, 3.0}
    assert prefilled[True] < prefilled[False]


# ----------------------------------------------------------------------------------------------------
# The trainer over multi-turn rollouts
# ----------------------------------------------------------------------------------------------------


class Fixed(Calc):
    """Always answers ``" ok"`` (3 tokens), reward 0.5, never done."""

    def step(self, action: str) -> tuple[str, float, bool]:
        return " ok", 0.5, False


def test_no_gradient_reaches_the_logits_of_observation_tokens(tiny_assets: Path, one_rank: Any) -> None:
    """A real model's multi-turn rollout (every turn one token: stop at any character), the actor's loss
    with an entropy bonus and a KL loss, advantages non-zero everywhere (observation positions included):
    the gradient of the loss with respect to the logits that predict observation tokens is exactly 0,
    and not at the generated ones."""
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_assets / "tokenizer")
    model = AutoModelForCausalLM.from_pretrained(tiny_assets / "base")
    turns = settings(tok, Fixed, stop=EVERY_CHARACTER, max_turns=3, max_response_length=16)
    sampler = Sampler(actor=model, engine=None, settings=RolloutConfig(), eos_ids=[EOS], pad_token_id=PAD,
                      max_response_length=16, multi_turn=turns)  # fmt: skip
    recs = records(tok, 4)
    rollout = sample(sampler, recs, do_sample=True)
    observed = rollout.attention_mask & ~rollout.response_mask
    assert observed.sum() >= 4 * 3 and rollout.response_mask.sum() >= 4  # every row called the tool
    cfg = load_config(None, ["actor.entropy_coeff=0.01", "actor.use_kl_loss=true", "data.max_response_length=16",
                             "algorithm.use_kl_in_reward=false", "actor.ppo_epochs=2"])  # fmt: skip
    batch = Batch(rollout=rollout, records=recs, group_ids=group_index(4, 2, torch.device("cpu")))
    gen = torch.Generator().manual_seed(1)
    batch.old_logprobs = -torch.rand(4, 16, generator=gen)
    batch.ref_logprobs = -torch.rand(4, 16, generator=gen)
    batch.advantages = torch.randn(4, 16, generator=gen)
    logits: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, inputs: Any, out: torch.Tensor) -> None:
        out.retain_grad()
        logits.append(out)

    hook = model.lm_head.register_forward_hook(keep)
    sel = batch.rows()
    loss, _ = actor_loss(cfg, model, batch, ulysses.NO_SP)(sel, global_counts(batch.response_mask))
    loss.backward()
    hook.remove()
    grad = logits[0].grad.reshape(-1, logits[0].shape[-1])  # [T, V] over the packed row
    index = pack_rows(batch, sel).response_index
    assert grad[index[observed]].abs().max().item() == 0.0
    assert grad[index[rollout.response_mask]].abs().amax(-1).min().item() > 0.0


def test_rewards_and_gae_across_an_observation_span_by_hand(one_rank: Any) -> None:
    """One response: generated, generated (turn end, step reward 0.5), two observation tokens, generated
    (the last: the score 1.0 lands here), one observation token after it (the step that said done).
    gamma 0.9, lam 0.8, values [0.1, 0.2, 9, 9, 0.3, 9]:

        t=4: delta = 1 - 0.3 = 0.7                      A = 0.7
        t=1: delta = 0.5 + 0.9 * 0.3 - 0.2 = 0.57       A = 0.57 + 0.72 * 0.7 = 1.074
        t=0: delta = 0.9 * 0.2 - 0.1 = 0.08             A = 0.08 + 0.72 * 1.074 = 0.85328

    the observation positions are skipped (the value after them bootstraps the token before them), so
    the returns A + V equal GAE over the generated tokens alone."""
    exists = torch.tensor([[True] * 6])
    generated = torch.tensor([[True, True, False, False, True, False]])
    rollout = Rollout(prompts=[torch.tensor([5, 6])], responses=torch.full((1, 6), 9), attention_mask=exists,
                      truncated=torch.tensor([False]), response_mask=generated,
                      env_rewards=torch.tensor([[0.0, 0.5, 0, 0, 0, 0]]))  # fmt: skip
    batch = Batch(rollout=rollout, records=[None], group_ids=torch.tensor([0]))
    batch.scores = torch.tensor([1.0])
    batch.values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 9.0]])
    cfg = load_config(None, ["algorithm.gamma=0.9", "algorithm.lam=0.8", "algorithm.use_kl_in_reward=false"])
    assert cfg.algorithm.adv_estimator == "gae"
    batch_advantages.compute_advantages(cfg, batch, algorithms.FixedKLController(0.0), step=1)
    assert batch.token_rewards.tolist() == [[0.0, 0.5, 0.0, 0.0, 1.0, 0.0]]
    torch.testing.assert_close(
        batch.returns, torch.tensor([[0.85328 + 0.1, 1.074 + 0.2, 0, 0, 0.7 + 0.3, 0]])
    )
    compact, _ = algorithms.compute_gae(torch.tensor([[0.0, 0.5, 1.0]]), torch.tensor([[0.1, 0.2, 0.3]]),
                                        torch.ones(1, 3, dtype=torch.bool), 0.9, 0.8, whiten=False)  # fmt: skip
    torch.testing.assert_close(batch.returns[generated], (compact + torch.tensor([[0.1, 0.2, 0.3]]))[0])
    assert (batch.advantages[~generated] == 0).all()


# ----------------------------------------------------------------------------------------------------
# End to end
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def turn_files(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """16 prompts in file order with ``extra_info.index`` = the row (``TurnsByRow`` reads it), and a
    preset that runs them multi-turn: every turn is one token (stop at any character)."""
    folder = tmp_path_factory.mktemp("turns")
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:16]
    for i, row in enumerate(rows):
        row["extra_info"] = {"index": i}
    prompts = write_parquet(folder / "prompts.parquet", rows)
    preset = folder / "turns.yaml"
    multi = {"enable": True, "env": f"{REWARD_FNS}:TurnsByRow", "stop": EVERY_CHARACTER}
    preset.write_text(yaml.safe_dump({"rollout": {"multi_turn": multi}}))
    return prompts, preset


def turn_args(tiny_assets: Path, files: tuple[Path, Path], out: Path, steps: int = 2) -> list[str]:
    prompts, preset = files
    return ["--config", str(preset), *base_args(tiny_assets, out, steps=steps), f"data.train_files={prompts}",
            "data.shuffle=false", "data.max_response_length=16", "trainer.val_before_train=false"]  # fmt: skip


@pytest.mark.slow
def test_uneven_turns_on_two_ranks_and_sp_equal_one_rank(
    tiny_assets: Path, turn_files: tuple[Path, Path], tmp_path: Path
) -> None:
    """Greedy multi-turn rollouts where rank 0's rows take 1 tool call and rank 1's take 3: no hang, and
    2 ranks (and 2 ranks as one SP group) log the same metrics and train the same parameters as 1 rank."""
    common = [
        "rollout.do_sample=false",
        "actor.ppo_mini_batch_size=4",
        "trainer.save_hf_on_end=true",
        "actor.optim.eps=1e-3",
        "critic.optim.eps=1e-3",
    ]  # fmt: skip  (see test_two_ranks_equal_one_rank)
    one, two, sp = tmp_path / "one", tmp_path / "two", tmp_path / "sp"
    assert run(turn_args(tiny_assets, turn_files, one) + common) == 0
    rows = read_metrics(one)
    # 2 prompts x 2 responses with 1 call and 2 x 2 with 3: 2 calls a response on average, each a turn,
    # then the final turn (none: the last call said done); 3 observation tokens (" ok") a call.
    assert [r["rollout/tool_calls/mean"] for r in rows] == [2.0, 2.0]
    assert [r["rollout/observation_tokens/mean"] for r in rows] == [6.0, 6.0]
    # generated tokens only: at least the one token of each call's turn (a space or a special token
    # does not complete a stop string, so some turns are longer), far below the 8 of turns + observations
    assert all(2.0 <= r["response_length/mean"] < 8.0 for r in rows)
    for out, extra in ((two, []), (sp, ["actor.ulysses_sequence_parallel_size=2"])):
        proc = torchrun(ROOT / "train_ppo.py", *turn_args(tiny_assets, turn_files, out), *common, *extra,
                        "trainer.dist_timeout_s=120")  # fmt: skip
        assert proc.returncode == 0, excerpt(proc.stderr)
        for x, y in zip(rows, read_metrics(out), strict=True):
            for key in ("rollout/turns/mean", "rollout/tool_calls/mean", "critic/score/mean", "critic/rewards/mean",
                        "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "actor/entropy"):  # fmt: skip
                assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), (out.name, key, x["step"])
        a, b = hf_weights(one), hf_weights(out)
        for key in a:
            torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=1e-5, msg=f"{out.name}: {key}")
    base = load_file(tiny_assets / "base" / "model.safetensors")
    assert any(not torch.equal(hf_weights(one)[k], base[k]) for k in base)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # the in-process run as the subprocesses run (OMP_NUM_THREADS=1)
def test_a_run_killed_in_an_environment_step_resumes_to_the_same_metrics(
    tiny_assets: Path, turn_files: tuple[Path, Path], tmp_path: Path
) -> None:
    """SIGKILL inside ``step`` during step 2; the resumed run (from step 1's checkpoint) samples the same
    trajectories, so every metric and the final weights equal a run never killed."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    common = ["trainer.save_freq=1", "trainer.save_hf_on_end=true"]
    assert run(turn_args(tiny_assets, turn_files, straight, steps=3) + common) == 0
    first = read_metrics(straight)[0]
    calls_in_step_1 = round(first["rollout/tool_calls/mean"] * 8)  # 4 prompts x 2 responses
    marker = tmp_path / "in_step"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PPO_TEST_ENV_SLOW_CALL": str(calls_in_step_1 + 2),
           "PPO_TEST_ENV_MARKER": str(marker), "PPO_TEST_ENV_SLOW_S": "600"}  # fmt: skip
    args = [
        sys.executable,
        str(ROOT / "train_ppo.py"),
        *turn_args(tiny_assets, turn_files, killed, steps=3),
        *common,
    ]
    proc = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)
    wait_until(proc, marker.exists, timeout=300)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert (killed / "checkpoints" / "latest").read_text() == "step_00000001"
    resumed = subprocess.run(args, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert resumed.returncode == 0, excerpt(resumed.stderr)
    assert deterministic(read_metrics(killed)) == deterministic(read_metrics(straight))
    a, b = hf_weights(straight), hf_weights(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.multi_turn.env=nowhere.py:Calc"], r"rollout.multi_turn.env='nowhere.py:Calc': file nowhere.py does not exist"),
        (["rollout.source=dataset", "algorithm.adv_estimator=grpo"],
         r"rollout.multi_turn.enable=true runs the environment between the model's turns, but offline groups"),
        (["rollout.compile=true"], r"rollout.compile=true is not available with it"),
    ],
)  # fmt: skip
def test_bad_multi_turn_input_is_one_line_at_start_up(
    tiny_assets: Path, turn_files: tuple[Path, Path], tmp_path: Path, overrides: list[str], message: str,
    capsys: pytest.CaptureFixture,
) -> None:  # fmt: skip
    args = turn_args(tiny_assets, turn_files, tmp_path) + overrides
    assert run(args) == 2
    err = capsys.readouterr().err
    problems = [line for line in err.splitlines() if "ERROR" in line or "rror:" in line]
    assert "Traceback" not in err and len(problems) == 1 and re.search(message, problems[0]), err


def test_the_calculator_example() -> None:
    calc = load_environment(f"{ROOT / 'configs' / 'calculator.py'}:Calculator")()
    assert calc.reset({"ground_truth": "85"}) is None
    assert calc.step("47+38=<calc>47+38</calc>") == ("<result>85</result>", 0.0, False)
    assert calc.step("then <calc>(2 - 9) * 3</calc>") == ("<result>-21</result>", 0.0, False)
    assert calc.step("<calc>__import__('os')</calc>") == ("<result>error</result>", 0.0, False)
    assert calc.step("<calc>2 ** 99</calc>") == ("<result>error</result>", 0.0, True)  # the 4th call ends it
