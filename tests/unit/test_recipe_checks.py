"""PRIME's and SPPO's settings that would train nothing, or something else than asked, without a word:
each is refused at start-up with a one-line message naming its keys and what to set, or (a verl key
whose name means another number here) named in a start-up warning. Through ``load_config``, as
``train_ppo.py`` loads a run's config."""

from __future__ import annotations

from ppo.config_loader import load_config
from tests.helpers import override_error

PRIME = ["algorithm.adv_estimator=prime"]
SPPO = ["actor.policy_loss.loss_mode=sppo", "rollout.n=2"]


RM_SCORES = (
    "reads each response's score as a 0/1 verdict ({use}; verl's PRIME recipe scores with its rule "
    "verifier), but reward.style=model scores with a reward model, whose scores are unbounded: score with "
    "the rule or a reward.custom_function returning 0/1, or rank with the reward model (reward.style=ranking "
    "reward.ranking_by=model: scores in [0, 1]) (from the command line)"
)


def test_prime_refuses_a_reward_models_unbounded_scores() -> None:
    """PRIME's PRM trains on outcome labels in [0, 1] (verl's recipe: its rule verifier's 0/1); a reward
    model's scores were clipped into them, so a score of 3.2 and one of 1.0 made the same label."""
    rm = ["reward.style=model", "reward.model_path=/m/rm"]
    assert override_error(*PRIME, *rm) == "algorithm.adv_estimator=prime " + RM_SCORES.format(
        use="the PRM's outcome label, clipped to [0, 1]"
    )
    # The accuracy filter (score >= 1 is right) reads the same verdict, with any estimator.
    filtered = ["data.filter_accuracy=true", "data.gen_batch_size=64"]
    assert override_error(*filtered, *rm) == "data.filter_accuracy=true " + RM_SCORES.format(
        use="right when it is >= 1"
    )
    # The reward model's ranks are scores in [0, 1]: accepted.
    cfg = load_config(
        None, [*PRIME, "reward.style=ranking", "reward.ranking_by=model", "reward.model_path=/m"]
    )
    assert (cfg.reward.style, cfg.reward.ranking_by) == ("ranking", "model")


def test_the_accuracy_filter_needs_more_prompts_than_it_keeps() -> None:
    """data.gen_batch_size unset is data.train_batch_size: the filter sampled one batch and kept all of
    it, filtering nothing. verl's recipe samples oversample_factor (its script: 4) times the batch."""
    expected = (
        "data.filter_accuracy=true samples data.gen_batch_size={gen} prompts a step and keeps "
        "data.train_batch_size={train} of them, so it keeps every group and filters nothing: set "
        "data.gen_batch_size to a larger multiple of data.train_batch_size (verl's PRIME recipe samples 4 "
        "times the batch, data.oversample_factor=4: data.gen_batch_size={four}) ({sources})"
    )
    assert override_error(*PRIME, "data.filter_accuracy=true") == expected.format(
        gen=32,
        train=32,
        four=128,
        sources="data.filter_accuracy from the command line; data.gen_batch_size from the defaults",
    )
    assert override_error(
        *PRIME, "data.filter_accuracy=true", "data.train_batch_size=8", "data.gen_batch_size=8"
    ) == expected.format(gen=8, train=8, four=32, sources="from the command line")
    # verl's spelling of no oversampling, data.oversample_factor=1, is refused the same way.
    assert "filters nothing" in override_error(
        *PRIME, "data.filter_accuracy=true", "data.oversample_factor=1"
    )
    cfg = load_config(None, [*PRIME, "data.filter_accuracy=true", "data.gen_batch_size=128"])
    assert cfg.data.gen_batch_size // cfg.data.train_batch_size == 4


def test_prime_refuses_both_coefficients_zero() -> None:
    """returns = Σ_s (reward_dpo_coef * dense_s + reward_gt_coef * outcome_s): with both 0 every return,
    so every whitened advantage, is 0."""
    assert override_error(*PRIME, "algorithm.reward_dpo_coef=0", "algorithm.reward_gt_coef=0.0") == (
        "algorithm.reward_dpo_coef=0 and algorithm.reward_gt_coef=0 weigh PRIME's process and outcome "
        "returns by 0, so every advantage is 0 and the actor does not train: set either above 0 (verl's "
        "PRIME recipe: 5 and 5) (from the command line)"
    )
    # Either one alone trains: the outcome's RLOO, or the process rewards' RLOO.
    for zero in ("algorithm.reward_dpo_coef=0", "algorithm.reward_gt_coef=0"):
        assert load_config(None, [*PRIME, zero]).algorithm.adv_estimator == "prime"
    # Without PRIME the coefficients are unused.
    load_config(None, ["algorithm.reward_dpo_coef=0", "algorithm.reward_gt_coef=0"])


BETA_MEANS = (
    "algorithm.sppo_beta (verl's SPPO recipe writes it algorithm.sppo_eta) is the beta of the soft-mean "
    "baseline of algorithm.sppo_target=softmean, not a step size; SPPO's step size eta is actor.sppo_eta={eta}"
)


def test_verls_sppo_eta_is_named_with_our_beta() -> None:
    """verl's SPPO recipe key algorithm.sppo_eta is the soft mean's beta (our algorithm.sppo_beta), while
    the step size eta is actor.sppo_eta: a warning that the beta is unused names both keys and their
    meanings, so whoever wrote algorithm.sppo_eta for the step size finds actor.sppo_eta."""
    cfg = load_config(None, [*SPPO, "algorithm.sppo_eta=3.0"])
    assert cfg.algorithm.sppo_beta == 3.0 and cfg.actor.sppo_eta == 1.0
    assert [w for w in cfg.warnings() if "sppo" in w] == [
        "algorithm.sppo_target=win_rate does not use algorithm.sppo_beta=3.0: "
        + BETA_MEANS.format(eta=1.0)
        + ", which the win-rate target uses; verl's SPPO recipe trains on algorithm.sppo_target=softmean"
    ]
    cfg = load_config(None, ["algorithm.sppo_eta=3.0", "actor_rollout_ref.actor.sppo_eta=0.5"])
    assert [w for w in cfg.warnings() if "sppo" in w] == [
        "actor.policy_loss.loss_mode=vanilla does not use actor.sppo_eta=0.5, algorithm.sppo_beta=3.0 "
        "(SPPO's keys); " + BETA_MEANS.format(eta=0.5)
    ]
    # With the soft-mean target the beta is used as verl's recipe uses it: nothing to say.
    cfg = load_config(None, [*SPPO, "algorithm.sppo_eta=3.0", "algorithm.sppo_target=softmean"])
    assert cfg.algorithm.sppo_beta == 3.0
    assert not [w for w in cfg.warnings() if "sppo" in w]


def test_verls_sppo_eta_says_which_key_of_ours_it_sets() -> None:
    """verl's SPPO recipe's ``algorithm.sppo_eta`` is the soft-mean's beta; a start-up note says so
    whenever it is given (before, it was renamed without a word, and a reader took it for the step size)."""
    notes: list[str] = []
    cfg = load_config(None, ["algorithm.sppo_eta=0.5"], notes=notes)
    assert (cfg.algorithm.sppo_beta, cfg.actor.sppo_eta) == (0.5, 1.0)
    assert notes[0] == (
        "algorithm.sppo_eta=0.5 (from the command line) is algorithm.sppo_beta here: the beta of the soft-mean "
        "baseline (algorithm.sppo_target=softmean), as in verl's SPPO recipe; the step size eta is actor.sppo_eta"
    )
