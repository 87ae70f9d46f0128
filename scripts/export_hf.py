"""Export a trained actor (and optionally the critic) from a sharded checkpoint to a Hugging Face folder.

    python scripts/export_hf.py outputs/run/checkpoints/step_00000040 outputs/run/hf [--critic]
    torchrun --nproc_per_node=8 scripts/export_hf.py CKPT_DIR OUT_DIR   # large models: shard the load

Reads the run's resolved ``config.yaml`` from the checkpoint, builds the models from ``model.path`` (and
``critic.model_path``), loads the checkpoint's weights (any world size: DCP reshards) and writes
``save_pretrained`` folders with the tokenizer: the actor to ``OUT_DIR``, the critic to
``OUT_DIR/critic``. Load them back with ``AutoModelForCausalLM.from_pretrained(OUT_DIR)``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ppo import checkpoint, models, sharding
from ppo.config import PPOConfig, load_config
from ppo.distributed import destroy_distributed, init_distributed, make_mesh, setup_logging

logger = logging.getLogger("ppo")


def export(ckpt_dir: Path, out_dir: Path, *, with_critic: bool = False) -> None:
    """Write the checkpoint's actor (and critic) as ``save_pretrained`` folders (collective)."""
    if not (ckpt_dir / "config.yaml").is_file():
        raise checkpoint.CheckpointError(
            f"{ckpt_dir} has no config.yaml: is it a checkpoint folder (step_N)?"
        )
    cfg = load_config(ckpt_dir / "config.yaml", [], PPOConfig)
    info = init_distributed("cpu" if cfg.trainer.device == "cpu" else "auto", cfg.trainer.dist_timeout_s)
    kw = dict(
        dtype=cfg.model.dtype, attn_implementation="eager", trust_remote_code=cfg.model.trust_remote_code
    )
    tokenizer = models.load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code)
    actor = sharding.shard_model(
        models.load_causal_lm(cfg.model.path, **kw), make_mesh(info), cfg.actor.fsdp, device=info.device
    )
    to_load = {"actor": actor}
    if with_critic:
        critic = models.load_critic(cfg.critic.model_path or cfg.model.path, **kw)
        to_load["critic"] = sharding.shard_model(critic, make_mesh(info), cfg.critic.fsdp, device=info.device)
    checkpoint.load_models(ckpt_dir, to_load)
    models.save_hf(actor, tokenizer, out_dir, is_main=info.is_main)
    if with_critic:
        models.save_hf(to_load["critic"], tokenizer, out_dir / "critic", is_main=info.is_main)
    logger.info("exported %s to %s", ckpt_dir, out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "ckpt_dir", type=Path, help="a checkpoint folder (step_N) or a run folder (uses latest)"
    )
    parser.add_argument("out_dir", type=Path, help="where the Hugging Face folder goes")
    parser.add_argument("--critic", action="store_true", help="also export the critic to OUT_DIR/critic")
    args = parser.parse_args(argv)
    setup_logging(True)
    ckpt_dir = args.ckpt_dir
    if not checkpoint.is_complete(ckpt_dir):  # a run folder: take its latest complete checkpoint
        ckpt_dir = checkpoint.find_resume_dir(ckpt_dir, "auto") or ckpt_dir
    try:
        export(ckpt_dir, args.out_dir, with_critic=args.critic)
    except (checkpoint.CheckpointError, FileNotFoundError) as e:
        logger.error("%s", e)
        return 2
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
