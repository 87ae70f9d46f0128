"""Health warnings fire once per occurrence."""

from __future__ import annotations

from ppo.config_loader import load_config
from ppo.monitor import KL_PATIENCE, HealthMonitor


def test_warnings_fire_once_per_occurrence() -> None:
    cfg = load_config(
        None,
        [
            "trainer.warn_entropy_below=0.5",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.target_kl=0.1",
        ],
    )
    mon = HealthMonitor(cfg=cfg)
    ok = {
        "actor/entropy": 1.0,
        "critic/score/mean": 0.5,
        "response_length/mean": 10.0,
        "actor/reward_kl_penalty": 0.0,
    }
    assert mon.check(1, ok) == {}
    low = {**ok, "actor/entropy": 0.1}
    assert mon.check(2, low) == {"warn/low_entropy": 1.0}
    assert mon.check(3, low) == {}  # still low: no second warning
    assert mon.check(4, ok) == {}
    assert mon.check(5, low) == {"warn/low_entropy": 1.0}  # a new occurrence


def test_kl_swing_and_length_warnings() -> None:
    cfg = load_config(
        None,
        ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.1", "data.max_response_length=20"],
    )
    mon = HealthMonitor(cfg=cfg)
    base = {"critic/score/mean": 0.50, "response_length/mean": 10.0, "actor/reward_kl_penalty": 0.2}
    fired = [mon.check(s, base) for s in range(1, KL_PATIENCE + 2)]
    # The KL stays above target: the warning fires on the KL_PATIENCE-th step, once.
    assert [("warn/kl_above_target" in f) for f in fired] == [False] * (KL_PATIENCE - 1) + [True, False]
    # Six steps at 0.50: the average is 0.50. 0.60 is 20% away (no swing), 0.70 after it is 0.70 vs
    # 0.7 * 0.50 + 0.3 * 0.60 = 0.53, 32% away (> 25%): a swing.
    assert "warn/reward_swing" not in mon.check(10, {**base, "critic/score/mean": 0.60})
    assert "warn/reward_swing" in mon.check(11, {**base, "critic/score/mean": 0.70})
    assert mon.check(12, {**base, "critic/score/mean": 0.58, "response_length/mean": 20.0}) == {
        "warn/length_pinned": 1.0
    }


def test_one_noisy_batch_does_not_swing() -> None:
    """Before SWING_WARMUP steps of history nothing fires, however the first scores jump."""
    mon = HealthMonitor(cfg=load_config(None, []))
    fired = [mon.check(s, {"critic/score/mean": v}) for s, v in enumerate([0.2, 0.6, 0.3, 0.5, 0.4], 1)]
    assert fired == [{}] * 5
