"""Export a trained actor (and optionally the critic) from a sharded checkpoint to a Hugging Face folder.

    python scripts/export_hf.py outputs/run/checkpoints/step_00000040 outputs/run/hf [--critic]
    python scripts/export_hf.py outputs/run outputs/run/hf_adapter --adapter     # LoRA: adapters only
    torchrun --nproc_per_node=8 scripts/export_hf.py CKPT_DIR OUT_DIR   # large models: shard the load

Reads the run's resolved ``config.yaml`` from the checkpoint, builds the models from ``model.path`` (and
``critic.model_path``) as the trainer did (with their LoRA adapters, if any), loads the checkpoint's
weights (any world size: DCP reshards) and writes folders with the tokenizer: the actor to ``OUT_DIR``, the
critic to ``OUT_DIR/critic``. A folder that already holds files (another model, an earlier export) is
refused unless ``--overwrite`` is given, which names what it replaces before writing.

A model trained with LoRA is written either merged (``W + (alpha / r) B A`` in every adapted layer: a plain
``save_pretrained`` folder, loaded with ``AutoModelForCausalLM.from_pretrained(OUT_DIR)``) or as its
adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, loaded with
``PeftModel.from_pretrained(base, OUT_DIR)``). The default is the run's ``actor.lora.save_merged`` (and
``critic.lora.save_merged``); ``--merged`` / ``--adapter`` override it for both. A model without LoRA is
always written whole.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ppo import checkpoint_files, lora, model_setup, ulysses
from ppo.config import ConfigError, PPOConfig
from ppo.config_loader import load_config
from ppo.distributed import (
    destroy_distributed,
    exit_process,
    init_distributed,
    setup_logging,
)

logger = logging.getLogger("ppo")


def claim_out_dir(out_dir: Path, *, with_critic: bool, overwrite: bool) -> None:
    """Refuse an ``out_dir`` (or ``out_dir/critic``) that holds files unless ``overwrite``; with it, log
    which files the export replaces. Checked before anything loads."""
    folders = [out_dir] + ([out_dir / "critic"] if with_critic else [])
    for folder in folders:
        if folder.exists() and not folder.is_dir():
            raise checkpoint_files.CheckpointError(f"{folder} is a file: the export writes a folder there")
    held = [p for folder in folders if folder.is_dir() for p in sorted(folder.iterdir())]
    held = [p for p in held if p != out_dir / "critic" or not with_critic]
    if not held:
        return
    names = ", ".join(str(p.relative_to(out_dir)) for p in held[:8]) + (
        f" and {len(held) - 8} more" if len(held) > 8 else ""
    )
    if not overwrite:
        raise checkpoint_files.CheckpointError(
            f"{out_dir} already holds files ({names}): choose another folder, or pass --overwrite to "
            "write the export over them"
        )
    logger.warning("--overwrite: the export writes over %s in %s", names, out_dir)


def export(
    ckpt_dir: Path,
    out_dir: Path,
    *,
    with_critic: bool = False,
    merged: bool | None = None,
    overwrite: bool = False,
) -> None:
    """Write the checkpoint's actor (and critic) as Hugging Face folders (collective).

    ``merged``: for LoRA models, the merged model (True) or the adapter folder (False); ``None`` follows
    each role's ``lora.save_merged`` in the checkpoint's config. ``overwrite``: write into folders that
    already hold files (refused otherwise).
    """
    claim_out_dir(out_dir, with_critic=with_critic, overwrite=overwrite)
    if not (ckpt_dir / "config.yaml").is_file():
        raise checkpoint_files.CheckpointError(
            f"{ckpt_dir} has no config.yaml: is it a checkpoint folder (step_N)?"
        )
    cfg = load_config(ckpt_dir / "config.yaml", [], PPOConfig)
    if with_critic and not cfg.use_critic:
        raise ConfigError(
            f"--critic: the run of {ckpt_dir} has no critic (algorithm.adv_estimator="
            f"{cfg.algorithm.adv_estimator} uses a group baseline): export the actor without --critic"
        )
    roles = [("actor", cfg.actor.lora)] + ([("critic", cfg.critic.lora)] if with_critic else [])
    for role, lora_cfg in roles:
        if merged is False and not lora.uses_lora(lora_cfg):
            raise ConfigError(
                f"--adapter: the checkpoint's {role} has no LoRA adapters ({role}.lora.rank=0); export it "
                "without --adapter"
            )
    info = init_distributed("cpu" if cfg.trainer.device == "cpu" else "auto", cfg.trainer.dist_timeout_s)
    tokenizer = model_setup.load_tokenizer(cfg.model)
    # The actor and the critic as the trainer builds them (base weights, LoRA adapters, sharding).
    to_load = {"actor": model_setup.actor(cfg, info, ulysses.NO_SP)}
    if with_critic:
        to_load["critic"] = model_setup.critic(cfg, info, ulysses.NO_SP)
    checkpoint_files.load_models(ckpt_dir, to_load)
    for role, lora_cfg in roles:
        folder = out_dir if role == "actor" else out_dir / "critic"
        as_merged = lora_cfg.save_merged if merged is None else merged
        lora.save_hf(to_load[role], tokenizer, folder, is_main=info.is_main, merged=as_merged)
        what = "model" if not lora.uses_lora(lora_cfg) else "merged model" if as_merged else "adapter folder"
        logger.info("exported the %s of %s as a %s to %s", role, ckpt_dir, what, folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "ckpt_dir", type=Path, help="a checkpoint folder (step_N) or a run folder (uses latest)"
    )
    parser.add_argument("out_dir", type=Path, help="where the Hugging Face folder goes")
    parser.add_argument("--critic", action="store_true", help="also export the critic to OUT_DIR/critic")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into OUT_DIR even if it already holds files (a model there is replaced)",
    )
    form = parser.add_mutually_exclusive_group()
    form.add_argument(
        "--merged",
        dest="merged",
        action="store_const",
        const=True,
        help="LoRA: write the merged model (default: the run's lora.save_merged)",
    )
    form.add_argument(
        "--adapter",
        dest="merged",
        action="store_const",
        const=False,
        help="LoRA: write the adapter folder (loads with peft on top of the base model)",
    )
    args = parser.parse_args(argv)
    setup_logging(True)
    ckpt_dir = args.ckpt_dir
    if not checkpoint_files.is_complete(ckpt_dir):  # a run folder: take its latest complete checkpoint
        ckpt_dir = checkpoint_files.find_resume_dir(ckpt_dir, "auto") or ckpt_dir
    try:
        export(ckpt_dir, args.out_dir, with_critic=args.critic, merged=args.merged, overwrite=args.overwrite)
    except (checkpoint_files.CheckpointError, ConfigError, FileNotFoundError) as e:
        logger.error("%s", e)
        return 2
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    exit_process(main())
