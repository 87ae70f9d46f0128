"""Every preset in configs/ resolves and validates for the world size it is sized for.

Each ``configs/*.yaml`` (a glob, so new presets are covered) runs through its entry point's
``--print-config --world-size N`` in-process, the way ``python train_ppo.py --config X --print-config
--world-size 32`` checks a preset on a machine with no GPU. N is ``trainer.nnodes *
trainer.n_gpus_per_node`` where the preset sets them, else the ``--nproc_per_node`` (x ``--nnodes``)
of the command in its comment, else 2 (the CPU demo). The printed YAML must load back into the same
config. A preset at a world size it does not fit must fail, naming the key to change.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import train_ppo
from ppo.config import DPOConfig, PPOConfig, RewardModelConfig, SFTConfig
from ppo.config_loader import load_config
from tests.helpers import demo_inputs, load_script

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))
GPU_PRESETS = [
    "qwen2_5_0_5b_gsm8k.yaml",
    "qwen2_5_7b_gsm8k.yaml",
    "qwen2_5_32b_gsm8k.yaml",
    "qwen2_5_7b_gsm8k_grpo.yaml",
]
DEMO_WORLD_SIZE = 2
PROGRAMS = {
    "train_sft.py": (SFTConfig, "train_sft"),
    "train_reward_model.py": (RewardModelConfig, "train_reward_model"),
    "train_dpo.py": (DPOConfig, "train_dpo"),
}
"""The stage programs, by the script a preset's header comment runs it with."""


def entry_for(path: Path) -> tuple[type, object]:
    """The config class and ``main(argv)`` of the program a preset is for: the stage script its header
    comment names, else the PPO trainer."""
    named = re.search(r"scripts/(train_\w+\.py)", path.read_text())
    if named and named.group(1) in PROGRAMS:
        cls, script = PROGRAMS[named.group(1)]
        return cls, load_script(script).main
    return PPOConfig, train_ppo.main


def stated_world_size(path: Path) -> int:
    """The world size a preset is sized for (see the module docstring)."""
    text = path.read_text()
    trainer = (yaml.safe_load(text) or {}).get("trainer") or {}
    if "nnodes" in trainer or "n_gpus_per_node" in trainer:
        return int(trainer.get("nnodes", 1)) * int(trainer.get("n_gpus_per_node", 1))
    comment = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    nproc = re.search(r"--nproc_per_node[= ](\d+)", comment)
    if nproc:
        nnodes = re.search(r"--nnodes[= ](\d+)", comment)
        return int(nproc.group(1)) * (int(nnodes.group(1)) if nnodes else 1)
    return DEMO_WORLD_SIZE


def test_presets_exist() -> None:
    names = {p.name for p in PRESETS}
    assert set(GPU_PRESETS) <= names, f"missing presets: {set(GPU_PRESETS) - names}"


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_validates_at_its_world_size(
    path: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cls, main = entry_for(path)
    world_size = stated_world_size(path)
    # The presets name the files of the machines they run on (assets/ after `make assets`, a hub id);
    # verl's base names none (a verl command line names them), so it is checked with the demo's.
    inputs = demo_inputs() if path.name in BASES else []
    code = main(
        [
            "--config",
            str(path),
            *inputs,
            "--print-config",
            "--allow-missing-paths",
            "--world-size",
            str(world_size),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, f"{path.name} at world size {world_size}: {err}"
    resolved = yaml.safe_load(out)
    assert isinstance(resolved, dict) and "trainer" in resolved
    # The printed YAML is the whole config: read back, it gives the same config.
    (tmp_path / "resolved.yaml").write_text(out)
    assert load_config(tmp_path / "resolved.yaml", cls=cls) == load_config(path, [*inputs], cls=cls)


BASES = {"verl_base.yaml"}
"""Presets a command line completes: they name no model or data."""
NO_VALIDATION = {"dpo_demo.yaml"}
"""Presets without ``data.val_files``: their header says so."""


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_names_its_inputs_and_resumes(path: Path) -> None:
    # The defaults name no model and no data: a preset names what it trains on, and its validation files
    # (or its header says why it has none). Started again, it resumes (trainer.resume_mode=auto).
    cls, _ = entry_for(path)
    cfg = load_config(path, cls=cls)
    if path.name in BASES:
        assert cfg.unset_inputs() == [
            "model.path is not set: give the policy's save_pretrained folder or hub id",
            "data.train_files is not set: give the Parquet files of training prompts",
        ]
        assert "not set here" in path.read_text().split("\n\n")[0]
        return
    assert cfg.unset_inputs() == [] and cfg.model.path and cfg.data.train_files
    assert bool(cfg.data.val_files) != (path.name in NO_VALIDATION), path.name
    if path.name in NO_VALIDATION:
        assert "No data.val_files" in path.read_text().split("\nmodel:")[0]
    assert cfg.trainer.resume_mode == "auto", path.name


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_preset_header_and_data(name: str) -> None:
    """A comment block on the hardware first; the data is what prepare_gsm8k.py writes."""
    text = (ROOT / "configs" / name).read_text()
    header = text.split("\n\n")[0].splitlines()
    assert all(line.startswith("#") for line in header[:5]), "the preset must start with a comment block"
    assert re.search(r"GPU", header[0]), header[0]
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.model.path.startswith("Qwen/Qwen2.5-")
    out = load_script("prepare_gsm8k").DEFAULT_OUT
    assert cfg.data.train_files == [f"{out}/train.parquet"]
    assert cfg.data.val_files == [f"{out}/test.parquet"]
    assert cfg.actor.fsdp.mixed_precision.param_dtype == "bfloat16"
    assert cfg.actor.fsdp.mixed_precision.reduce_dtype == "float32"


def test_preset_knobs() -> None:
    """The settings each GPU preset is for: model, batch and micro-batch sizes, KL, sharding, offload."""
    small = load_config(ROOT / "configs" / "qwen2_5_0_5b_gsm8k.yaml")
    assert small.model.path == "Qwen/Qwen2.5-0.5B-Instruct" and small.model.attn_implementation == "auto"
    assert small.actor.use_dynamic_bsz and small.use_critic
    assert small.trainer.nnodes * small.trainer.n_gpus_per_node == 1

    ppo7 = load_config(ROOT / "configs" / "qwen2_5_7b_gsm8k.yaml")
    assert ppo7.data.train_batch_size == 1024
    assert ppo7.actor.ppo_micro_batch_size_per_gpu == 4 and not ppo7.actor.use_dynamic_bsz
    assert ppo7.algorithm.kl_ctrl.kl_coef == 0.001 and ppo7.algorithm.use_kl_in_reward
    assert ppo7.model.enable_gradient_checkpointing

    big = load_config(ROOT / "configs" / "qwen2_5_32b_gsm8k.yaml")
    assert big.actor.fsdp.param_offload and big.ref.fsdp.param_offload
    assert big.actor.fsdp.fsdp_size == big.ref.fsdp.fsdp_size == 8
    assert (big.trainer.nnodes, big.trainer.n_gpus_per_node) == (4, 8)

    grpo = load_config(ROOT / "configs" / "qwen2_5_7b_gsm8k_grpo.yaml")
    assert grpo.algorithm.adv_estimator == "grpo" and grpo.rollout.n == 5 and not grpo.use_critic
    assert grpo.actor.use_kl_loss and grpo.actor.kl_loss_type == "low_var_kl"


@pytest.mark.parametrize(
    ("name", "world_size", "names"),
    [
        # 1024 prompts do not split over 12 ranks.
        ("qwen2_5_7b_gsm8k.yaml", 12, ["data.train_batch_size", "multiple of 12"]),
        # 256 prompts per mini-batch / 128 ranks = 2 sequences per rank: not a multiple of 4.
        ("qwen2_5_7b_gsm8k.yaml", 128, ["actor.ppo_micro_batch_size_per_gpu=4", "use_dynamic_bsz"]),
        # Hybrid shards of 8 GPUs cannot tile 36 ranks (512 prompts also do not split over 36).
        ("qwen2_5_32b_gsm8k.yaml", 36, ["actor.fsdp.fsdp_size=8", "ref.fsdp.fsdp_size=8"]),
    ],
)
def test_preset_at_wrong_world_size_names_the_fix(
    name: str, world_size: int, names: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    path = ROOT / "configs" / name
    code = train_ppo.main(["--config", str(path), "--print-config", "--world-size", str(world_size)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert f"does not fit world size {world_size}" in err
    for fragment in names:
        assert fragment in err, f"{fragment!r} not in: {err}"


def test_make_demo_starts_the_resuming_preset_over() -> None:
    # configs/demo_cpu.yaml resumes (trainer.resume_mode=auto): `make demo` reruns it from step 0 and
    # `make demo-resume` continues it, each saying so on its command line.
    makefile = (ROOT / "Makefile").read_text()
    recipes = dict(re.findall(r"^(demo|demo-resume): check-assets\n\t\$\(DEMO_PPO\) (.*)$", makefile, re.M))
    assert recipes == {
        "demo": "trainer.resume_mode=disable trainer.overwrite=true",
        "demo-resume": "trainer.resume_mode=auto",
    }
    assert "--config configs/demo_cpu.yaml" in makefile.split("\nDEMO_PPO := ", 1)[1].split("\n\n")[0]
