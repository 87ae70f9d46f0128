"""Smoke tests of the benchmarks of ppo_bench at tiny sizes, in-process (ppo_bench.sp on 2 ranks).

The rows must parse as JSON and hold the expected columns. ppo_bench.layout's packed paths run the
trainer's own step functions, and its padded baseline must compute the same step: the same log-probs and
values as the trainer's packed forwards, the same losses and gradient norms through ``optimize`` (else
its timings compare different work); so must the packed forwards with transformers' dense-mask sdpa
(``packed_dense``). ppo_bench.overhead runs the real trainer for a few steps, without TRL.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ppo_bench import common, layout, overhead, rewards, rollout, runs

from ppo.ulysses import NO_SP
from tests.helpers import excerpt, load_script, read_metrics, torchrun

ROLLOUT_COLUMNS = {
    "path",
    "decode_ms",
    "world_size",
    "num_prompts",
    "new_tokens",
    "time_s",
    "tokens_per_s",
    "ratio",
    "match",
    "gather_s",
}
LAYOUT_COLUMNS = {
    "path",
    "pad_frac",
    "real_tokens",
    "computed_tokens",
    "attn_entries",
    "gen_s",
    "old_log_prob_s",
    "ref_s",
    "values_s",
    "update_s",
    "train_s",
    "tokens_per_s",
    "speedup",
    "expected",
    "attn_vs_padded",
}


@pytest.fixture(autouse=True)
def single_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run as one rank without torchrun, and restore torch's thread count afterwards."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def json_rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_bench_rollout_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--json", "--num-prompts", "4", "--prompt-len", "8", "--new-tokens", "4"]
    assert rollout.main([*argv, "--micro-batch", "2", "--repeat", "1"]) == 0
    rows = json_rows(capsys.readouterr().out)
    assert [r["path"] for r in rows] == ["hf_generate", "ppo_rollout"]
    for row in rows:
        assert ROLLOUT_COLUMNS <= set(row), ROLLOUT_COLUMNS - set(row)
        assert row["tokens_per_s"] > 0 and row["num_prompts"] * row["new_tokens"] == 16
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] > 0
    # Greedy decoding of the same weights: our rollout on the sharded model makes the same tokens.
    assert rows[1]["match"] == 1.0


def test_bench_rollout_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--num-prompts", "2", "--prompt-len", "4", "--new-tokens", "2", "--repeat", "1"]
    assert rollout.main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:2] == ["path", "device"]
    assert "ppo_rollout / hf_generate =" in out


@pytest.mark.slow
def test_bench_layout_json(capsys: pytest.CaptureFixture[str]) -> None:
    """Every path at tiny size; the packed paths are the trainer's step (its functions, not copies), and
    the padded baseline computes the same step: equal losses and gradient norms, less than rounding
    apart. A padded loss closure that no longer matches ``ppo.optimize.actor_loss`` / ``critic_loss`` (a
    term, a normalization, a clip added to the trainer) shows up as a gradient-norm difference here."""
    from ppo import forwards, optimize

    assert layout.TRAINER.forward_logprobs is forwards.forward_logprobs
    assert layout.TRAINER.actor_loss is optimize.actor_loss
    assert layout.TRAINER.critic_loss is optimize.critic_loss
    argv = ["--json", "--num-seqs", "8", "--prompt-len", "8", "--min-response", "1", "--max-response", "12"]
    assert layout.main([*argv, "--micro-batch", "2", "--repeat", "1"]) == 0
    rows = json_rows(capsys.readouterr().out)
    assert [r["path"] for r in rows] == list(layout.PATHS)
    for row in rows:
        assert LAYOUT_COLUMNS <= set(row), LAYOUT_COLUMNS - set(row)
        assert all(math.isfinite(row[k]) and row[k] >= 0 for k in LAYOUT_COLUMNS - {"path"})
    padded, packed, dynamic, dense = rows
    assert padded["pad_frac"] > 0 and packed["pad_frac"] == 0
    # Same sequences, same micro-batches: the packed path feeds exactly the real tokens.
    assert packed["computed_tokens"] == 5 * packed["real_tokens"]  # old, ref, values, critic, actor
    assert padded["computed_tokens"] > packed["computed_tokens"]
    assert padded["speedup"] == 1.0 and packed["expected"] > 1.0
    # Per-sequence attention (the trainer's) against transformers' dense T x T mask: sum(l_i^2) < T^2.
    assert packed["attn_entries"] < dense["attn_entries"]
    assert dense["computed_tokens"] == packed["computed_tokens"] == dynamic["computed_tokens"]
    # One step of every path from the same weights, batch and mini-batches: the same numbers, up to
    # float32 summation order (measured ~3e-7 relative).
    for row in (packed, dynamic, dense):
        for key in ("pg_loss", "vf_loss", "actor_grad_norm", "critic_grad_norm"):
            assert row[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-6), (row["path"], key)
    assert padded["actor_grad_norm"] > 0 and padded["critic_grad_norm"] > 0 and padded["vf_loss"] > 0


def test_padded_forwards_match_packed() -> None:
    """The padded baseline's scoring and the dense-mask packed path compute what the trainer's scoring
    functions do, so their timings compare the same work; the padded actor loss gives the trainer's loss
    and metrics (each a share of the mini-batch) on a micro-batch of half the mini-batch."""
    from ppo import optimize
    from ppo.distributed import destroy_distributed, init_distributed

    args = layout.parse_args(
        ["--num-seqs", "4", "--prompt-len", "10", "--max-response", "8", "--micro-batch", "2"]
    )
    common.set_threads(args.threads)
    info = init_distributed("cpu")
    try:
        results = {}
        batch = None
        for name in ("packed", "padded", "packed_dense"):
            path = layout.make_path(args, name, info)
            nets = common.build_models(args, info, path.attn)
            # Each path loads its models with its own attention (a parameter, nothing patched).
            assert {net.config._attn_implementation for net in nets.values()} == {path.attn}
            if batch is None:
                batch, _ = layout.make_batch(args, info, nets["actor"], "cpu")
                assert len(set(batch.seq_lens)) > 1  # lengths differ, so there is padding to get wrong
            cfg, path_layout = path.cfg, path.layout
            logprobs = path_layout.forward_logprobs(cfg, nets["actor"], batch, 2, NO_SP)
            values = path_layout.forward_values(cfg, nets["critic"], batch, NO_SP)
            work = layout.count_work(path, batch, layout.scoring_forwards(cfg, batch))
            assert work.real == 3 * sum(batch.seq_lens)  # actor, reference, critic
            assert (work.computed > work.real) == (name == "padded")
            results[name] = (logprobs, values)
            if name in ("packed", "padded"):  # the actor's loss closure, metrics included, on one micro-batch
                if batch.old_logprobs is None:
                    generator = torch.Generator().manual_seed(0)
                    batch.old_logprobs = logprobs + 0.3 * torch.randn(logprobs.shape, generator=generator)
                    batch.advantages = torch.randn(logprobs.shape, generator=generator)
                sel = torch.arange(2)
                counts = optimize.global_counts(batch.response_mask)  # the micro-batch is half the mini-batch
                _, parts = path_layout.actor_loss(cfg, nets["actor"], batch, NO_SP)(sel, counts)
                results[f"{name}_parts"] = {k: float(v.detach()) for k, v in parts.items()}
        mask = batch.attention_mask
        packed_parts, padded_parts = results["packed_parts"], results["padded_parts"]
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
            assert padded_parts[key] == pytest.approx(packed_parts[key], rel=1e-4, abs=1e-6), key
        assert packed_parts["actor/pg_clipfrac"] > 0
        for name in ("padded", "packed_dense"):
            for got, want in zip(results[name], results["packed"], strict=True):
                torch.testing.assert_close(got[mask], want[mask], atol=2e-5, rtol=1e-5)
        assert results["packed"][0][mask].abs().sum() > 0 and (results["packed"][0][~mask] == 0).all()
    finally:
        destroy_distributed()


def test_step_clock_counts_step_lines_only() -> None:
    """The overhead benchmark's step clock (runs.StepClock) reads the trainer's progress lines, not warnings
    about a step."""
    import logging

    clock = runs.StepClock()
    for message in (
        "[##--] step 1/4 0s",
        "step 2: the mean score moved",
        "[###-] step 2/4 1s",
        "[####] step 3/4",
    ):
        clock.emit(logging.LogRecord("ppo", logging.INFO, __file__, 0, message, None, None))
    assert [m[0] for m in clock.marks] == [1, 2, 3]
    cpu, wall = clock.step_times(skip=2)
    assert len(cpu) == len(wall) == 1 and cpu[0] >= 0 and wall[0] >= 0  # step 3 only


def test_bench_overhead_json(capsys: pytest.CaptureFixture[str]) -> None:
    """ppo_bench.overhead runs the real trainer (train_ppo.main) and reads its metrics; TRL left out."""
    argv = ["--json", "--trl", "no", "--num-prompts", "4", "--response-len", "4"]
    assert overhead.main([*argv, "--steps", "4", "--rounds", "1"]) == 0
    rows = json_rows(capsys.readouterr().out)
    assert [r["trainer"] for r in rows] == ["ours"]
    row = rows[0]
    assert row["steps"] == 2  # steps 3 and 4
    assert 0 < row["step_cpu_min_s"] <= row["step_cpu_s"] <= row["step_cpu_max_s"]
    for phase in overhead.OUR_PHASES:
        assert row[f"{phase}_s"] is not None and row[f"{phase}_s"] >= 0, phase
    # Updates ran: 2 epochs x 2 mini-batches for critic and actor, timed inside the step.
    assert 0 < row["update_actor_s"] < row["step_wall_s"] and row["vs_trl"] is None


@pytest.mark.slow
def test_bench_rewards_json(capsys: pytest.CaptureFixture[str]) -> None:
    """The reward pool's throughput against the trainer's process, and the calls of a pool whose function
    hangs: what each call ends with (their seconds are what the benchmark is for, not checked here)."""
    assert rewards.main(["--json", "--responses", "20", "--repeat", "1", "--workers", "1"]) == 0
    (out,) = json_rows(capsys.readouterr().out)
    assert [r["way"] for r in out["rows"]] == ["in-process", "1 worker(s)"]
    assert all(r["s_per_1000"] > 0 for r in out["rows"]) and out["rows"][0]["vs_in_process"] == 1.0
    ends = {r["scenario"]: (r["timeouts"], r["abandoned"]) for r in out["scenarios"]}
    assert ends == {"timeout_replace": (2, 0), "total_timeout": (8, 0), "stop": (0, 3)}
    assert all(r["s_per_call"] > 0 and r["limit_s"] > 0 for r in out["scenarios"])


def test_cpu_peak_bytes_counts_allocations_once_and_frees_on_any_thread() -> None:
    """The benchmarks' CPU memory measure: a view or an in-place result allocates nothing, a tensor
    freed on another thread (as gloo's workers release a collective's buffers) stops counting."""
    import threading

    from ppo_bench import kernels

    mib = 2**20
    weight = torch.ones(mib // 4)  # exists before: never counted, nor are its views
    held: list[torch.Tensor] = []

    def run() -> None:
        _ = weight.t(), weight[:10], weight.view(-1, 4)
        a = weight * 2  # 1 MiB
        a.mul_(3)  # in place: nothing new
        held.append(a)
        del a
        worker = threading.Thread(target=held.clear)  # the last reference drops on another thread
        worker.start()
        worker.join()
        b = torch.ones(mib // 2)  # 2 MiB, after the first was freed
        del b

    assert kernels.cpu_peak_bytes(run) == 2 * mib


@pytest.mark.slow
def test_bench_sp_two_ranks() -> None:
    """``--sp 2`` on 2 gloo ranks: the same outputs as one rank per sequence, at a fraction of the memory."""
    proc = torchrun("-m", "ppo_bench.sp", "--sp", "2", "--seq-len", "1024", "--json", timeout=240)
    assert proc.returncode == 0, excerpt(proc.stderr)
    rows = json_rows(proc.stdout)
    assert [(r["sp"], r["phase"]) for r in rows] == [
        (s, p) for s in (1, 2) for p in ("actor", "critic", "ref")
    ]
    for row in rows:
        if row["sp"] == 1:
            assert row["vs_sp1"] == 1.0 and row["max_abs_diff"] == 0.0
            continue
        # Log-probs and values of the whole sequence equal one rank's (the same kernels per token).
        assert row["max_abs_diff"] <= 1e-5, row
        # Activations are split over 2 ranks; FSDP's gathered parameters and the gathered outputs are not.
        assert row["vs_sp1"] <= (0.6 if row["phase"] == "actor" else 0.7), row


@pytest.mark.slow
def test_gpu_check_pieces_on_cpu(
    tiny_assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What scripts/gpu_check.sh chains, at tiny sizes: a shaped model with random weights that the
    trainer loads like a checkpoint, a PPO run on it, the kernel benchmark's JSON, and the summary line
    that reads them (medians over the steps after the first)."""
    import train_ppo
    from ppo import model_loading

    gpu_summary, make_shaped_model = load_script("gpu_summary"), load_script("make_shaped_model")

    model_dir = make_shaped_model.make_shaped_model(
        "tiny", tiny_assets / "tokenizer", tmp_path / "model_tiny", dtype="float32", device="cpu", seed=0
    )
    loaded = model_loading.load_causal_lm(str(model_dir))
    assert loaded.config.hidden_size == 256 and loaded.config.num_hidden_layers == 4
    assert loaded.config.eos_token_id == 2 and (model_dir / "tokenizer.json").is_file()

    out = tmp_path / "runs"
    argv = [
        f"model.path={model_dir}",
        f"data.train_files=[{tiny_assets / 'data' / 'train.parquet'}]",
        "data.val_files=[]",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "data.max_response_length=6",
        "rollout.n=2",
        "rollout.ignore_eos=true",
        "algorithm.use_kl_in_reward=true",  # a reference model too: every phase of the summary
        "trainer.total_training_steps=3",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={out / 'ppo_tiny'}",
    ]
    assert train_ppo.main(argv) == 0
    assert rollout.main(["--json", "--num-prompts", "2", "--new-tokens", "2", "--repeat", "1"]) == 0
    (out / "rollout.jsonl").write_text(capsys.readouterr().out)
    (out / "pytest.txt").write_text("....s\n4 passed, 1 skipped in 3.2s\n")

    summary = gpu_summary.summarize(out)
    assert summary["kernel_tests"] == {"passed": 4, "failed": 0, "skipped": 1, "errors": 0}
    assert summary["kernels"] == {}  # the kernel benchmark did not run: no rows, no error
    assert summary["rollout"]["hf_decode_ms"] > 0 and summary["rollout"]["compiled_decode_ms"] is None
    steps = [s for s in read_metrics(out / "ppo_tiny") if "timing_s/step" in s]
    assert len(steps) == 3
    ppo = summary["ppo_tiny"]
    assert ppo["steps"] == 2  # the first step (compilation, warm-up) is left out
    for name, key in gpu_summary.PPO_KEYS.items():
        if key.startswith("perf/mfu"):  # needs a GPU's peak FLOP/s
            assert ppo[name] is None
        else:
            assert ppo[name] == pytest.approx((steps[1][key] + steps[2][key]) / 2), name
    assert ppo["response_length"] == 6  # ignore_eos: every response is full
