"""Export a trained actor (and optionally the critic) from a sharded checkpoint to a Hugging Face folder.

    python scripts/export_hf.py outputs/run/checkpoints/step_00000040 outputs/run/hf [--critic]
    python scripts/export_hf.py outputs/run outputs/run/hf_adapter --adapter     # LoRA: adapters only
    torchrun --nproc_per_node=8 scripts/export_hf.py CKPT_DIR OUT_DIR   # large models: shard the load

Reads the run's resolved ``config.yaml`` from the checkpoint, builds the models from ``model.path`` (and
``critic.model_path``) as the trainer did (with their LoRA adapters, if any), loads the checkpoint's
weights (any world size: DCP reshards) and writes folders with the tokenizer: the actor to ``OUT_DIR``, the
critic to ``OUT_DIR/critic``. A folder that already holds files (another model, an earlier export) is
refused unless ``--overwrite`` is given, which names what it replaces before writing.

The export is written into a hidden folder beside ``OUT_DIR`` (``.OUT_DIR.export-PID.tmp``) and moved into
place only once complete: a full disk or a folder that cannot be written ends with one line naming
``OUT_DIR`` and the system's reason (exit code 2), and leaves nothing behind (the hidden folder, and any
parent folder the command made, are removed). With ``--overwrite`` the export's files replace those of the
same name, and weight files of an earlier export that the new one lacks (another sharding, a merged model
replaced by adapters) are removed; other files stay. A run folder of ``scripts/train_sft.py``,
``train_reward_model.py`` or ``train_dpo.py`` is refused with where that run saves its model (already a
Hugging Face folder).

A model trained with LoRA is written either merged (``W + (alpha / r) B A`` in every adapted layer: a plain
``save_pretrained`` folder, loaded with ``AutoModelForCausalLM.from_pretrained(OUT_DIR)``) or as its
adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, loaded with
``PeftModel.from_pretrained(base, OUT_DIR)``). The default is the run's ``actor.lora.save_merged`` (and
``critic.lora.save_merged``); ``--merged`` / ``--adapter`` override it for both. A model without LoRA is
always written whole.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import shutil
from pathlib import Path

import yaml
from safetensors import SafetensorError

from ppo import checkpoint_files, lora, model_setup, ulysses
from ppo.config import ConfigError, PPOConfig
from ppo.config_loader import load_config
from ppo.distributed import (
    agree_on_failure,
    destroy_distributed,
    exit_process,
    init_distributed,
    setup_logging,
)

logger = logging.getLogger("ppo")

STAGES = {
    "sft": ("an SFT run", "scripts/train_sft.py", "model.path of a PPO run"),
    "rm": ("a reward-model run", "scripts/train_reward_model.py", "reward.model_path of a PPO run"),
    "dpo": ("a DPO run", "scripts/train_dpo.py", "model.path of a PPO run"),
}
"""Per stage: what its run folder is, the script that writes it, where its saved model is used."""

WEIGHT_FILE = re.compile(
    r"(adapter_model|model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?"
)
"""The weight files of a Hugging Face folder (whole, sharded, index, adapters): with ``--overwrite`` the
ones the new export does not write are removed, as ``save_pretrained`` removes stale shards."""

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NO_WRITE = (errno.EACCES, errno.EPERM, errno.EROFS)


def stage_run_error(folder: Path) -> checkpoint_files.CheckpointError | None:
    """The error for a run folder (or checkpoint) of SFT, the reward model or DPO: its ``config.yaml`` is a
    stage's (``trainer.save_path`` is a stage key), whose model the stage already saved as a Hugging Face
    folder at ``trainer.save_path`` (default ``<run>/hf``); None for anything else (``load_config`` judges
    it). Which stage: SFT's trainer has ``metrics_prefix``, the reward model's loss a ``margin``."""
    try:
        raw = yaml.safe_load((folder / "config.yaml").read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    trainer = raw.get("trainer") if isinstance(raw, dict) else None
    if not isinstance(trainer, dict) or "save_path" not in trainer:
        return None
    loss = raw.get("loss")
    stage = (
        "sft"
        if "metrics_prefix" in trainer
        else "rm"
        if isinstance(loss, dict) and "margin" in loss
        else "dpo"
    )
    what, script, use = STAGES[stage]
    run = folder.parent.parent if folder.parent.name == "checkpoints" else folder  # a stage's step_N
    saved = Path(trainer["save_path"]) if trainer["save_path"] else run / "hf"
    if (saved / "config.json").is_file() or (saved / "adapter_config.json").is_file():
        where = (
            f"its model is already a Hugging Face folder, {saved} (trainer.save_path): use that folder "
            f"(from_pretrained, or {use})"
        )
    else:
        where = (
            f"its model goes to {saved} (trainer.save_path) when the run ends and is not there yet: resume "
            f"the run (the same {script} command) to finish and save it"
        )
    return checkpoint_files.CheckpointError(
        f"{folder} is the folder of {what} ({script}), not of a PPO run: {where}; export_hf.py exports "
        "PPO checkpoints"
    )


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
    stage_error = stage_run_error(ckpt_dir)
    if stage_error is not None:
        raise stage_error
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
    # Rank 0 makes the staging folder before anything loads: a folder it cannot write fails at once.
    staging = agree_on_failure(
        lambda: make_staging(out_dir) if info.is_main else None, checkpoint_files.CheckpointError
    )
    written: list[tuple[str, str]] = []  # (role, what was written)
    try:
        tokenizer = model_setup.load_tokenizer(cfg.model)
        # The actor and the critic as the trainer builds them (base weights, LoRA adapters, sharding).
        to_load = {"actor": model_setup.actor(cfg, info, ulysses.NO_SP)}
        if with_critic:
            to_load["critic"] = model_setup.critic(cfg, info, ulysses.NO_SP)
        checkpoint_files.load_models(ckpt_dir, to_load)
        tmp = staging[0] if staging is not None else out_dir  # other ranks only gather, never write
        for role, lora_cfg in roles:
            folder = tmp if role == "actor" else tmp / "critic"
            as_merged = lora_cfg.save_merged if merged is None else merged
            try:
                lora.save_hf(to_load[role], tokenizer, folder, is_main=info.is_main, merged=as_merged)
            except (OSError, SafetensorError) as e:
                raise write_error(out_dir, e) from e
            kind = (
                "model" if not lora.uses_lora(lora_cfg) else "merged model" if as_merged else "adapter folder"
            )
            written.append((role, kind))
        if staging is not None:
            move_into_place(staging[0], out_dir)
    finally:
        if staging is not None:
            remove_staging(*staging)
    for role, kind in written:
        folder = out_dir if role == "actor" else out_dir / "critic"
        logger.info("exported the %s of %s as a %s to %s", role, ckpt_dir, kind, folder)


def make_staging(out_dir: Path) -> tuple[Path, list[Path]]:
    """Create the hidden folder the export is written into, beside ``out_dir`` (so the final move is a
    rename on one file system), and any missing parent folders; returns it and the parents it made
    (deepest first), which ``remove_staging`` removes if the export fails. CheckpointError when the
    folder cannot be made (read-only, full)."""
    target = out_dir.resolve()  # beside the real folder when out_dir is a link to another disk
    made = [p for p in [target.parent, *target.parent.parents] if not p.exists()]
    tmp = target.parent / f".{target.name}.export-{os.getpid()}.tmp"
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        remove_staging(tmp, made)
        raise write_error(out_dir, e) from e
    return tmp, made


def remove_staging(tmp: Path, made: list[Path]) -> None:
    """Remove the staging folder (if still there) and the parent folders this command made, if empty."""
    shutil.rmtree(tmp, ignore_errors=True)
    for parent in made:
        try:
            parent.rmdir()
        except OSError:
            break  # not empty (the export was moved in) or already gone


def move_into_place(tmp: Path, out_dir: Path) -> None:
    """Move the complete export from ``tmp`` to ``out_dir``: one rename when ``out_dir`` does not exist,
    else file by file, replacing files of the same name and removing stale weight files (``WEIGHT_FILE``)
    the export does not have (``claim_out_dir`` allowed this: empty, or ``--overwrite``)."""
    target = out_dir.resolve()
    try:
        if not target.exists():
            tmp.rename(target)
            return
        for src_dir, _, files in os.walk(tmp):
            dest = target / Path(src_dir).relative_to(tmp)
            dest.mkdir(exist_ok=True)
            for stale in [p for p in dest.iterdir() if WEIGHT_FILE.fullmatch(p.name) and p.name not in files]:
                stale.unlink()
            for name in files:
                os.replace(Path(src_dir) / name, dest / name)
    except OSError as e:
        raise write_error(out_dir, e) from e


def write_error(out_dir: Path, error: Exception) -> checkpoint_files.CheckpointError:
    """One line naming ``out_dir``, the system's reason and what to do."""
    code = error.errno if isinstance(error, OSError) else None
    reason = (error.strerror if isinstance(error, OSError) else None) or str(error).splitlines()[0]
    remedy = (
        "free space there or export to another disk"
        if code in NO_SPACE
        else "choose a folder you can write to"
        if code in NO_WRITE
        else "check the folder and export again"
    )
    return checkpoint_files.CheckpointError(
        f"cannot write the export to {out_dir}: {reason}; nothing was left there: {remedy}"
    )


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
    try:
        stage_error = stage_run_error(ckpt_dir)  # the folder given, before its checkpoints are looked at
        if stage_error is not None:
            raise stage_error
        if not checkpoint_files.is_complete(ckpt_dir):  # a run folder: take its latest complete checkpoint
            ckpt_dir = checkpoint_files.find_resume_dir(ckpt_dir, "auto") or ckpt_dir
        export(ckpt_dir, args.out_dir, with_critic=args.critic, merged=args.merged, overwrite=args.overwrite)
    except (checkpoint_files.CheckpointError, ConfigError, FileNotFoundError) as e:
        logger.error("%s", e)
        return 2
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    exit_process(main())
