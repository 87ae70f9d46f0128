"""Train a reward model on preference pairs with the Bradley-Terry loss.

    torchrun --nproc_per_node=2 scripts/train_reward_model.py --config configs/rm_demo.yaml [section.key=value ...]
    python scripts/train_reward_model.py --config configs/rm_demo.yaml --print-config [--world-size 8]

Reads Parquet rows with ``prompt``, ``chosen``, ``rejected`` (rows with an empty chosen or rejected, or
with both the same, are skipped and counted), starts from ``model.path`` as a sequence-scoring model
(``AutoModelForSequenceClassification``, ``num_labels=1``; a causal LM gets a fresh score head) and
minimizes ``-log sigmoid(r_chosen - r_rejected - loss.margin)`` averaged over the global batch of pairs.
Each micro-batch packs the chosen and rejected sequences of its pairs into one padding-free row; a
sequence's score is read at its last token. Held-out metrics: ``rm/accuracy`` (chosen scored above
rejected), ``rm/margin`` (mean ``r_chosen - r_rejected``), ``val/loss``, and ``rm/accuracy/<kind>``
when the data has a ``mistake`` column. The model is saved with ``save_pretrained``
(``trainer.save_path``, what PPO's ``reward.model_path`` loads) and ``rm_val_accuracy`` (with
``rm_val_accuracy_by_mistake``) is merged into ``metrics.json`` beside it.
"""

from __future__ import annotations

from ppo import cli
from ppo.config import RewardModelConfig

if __name__ == "__main__":  # --help and --print-config answer here, before torch and transformers load
    cli.answer_early(None, __doc__, RewardModelConfig)

# The imports below follow the early answer on purpose:
# ruff: noqa: E402
import functools
import logging

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from torch import nn

from ppo import model_loading, model_setup, models, run_folder, runner, stage_data, stage_loop
from ppo.distributed import DistInfo, all_gather_object, all_reduce_scalars, exit_process, rank_slice
from ppo.optim import with_optimizer
from ppo.packing import DUMMY_SEQUENCE, pack_sequences, plan_eval_micro_batches, plan_micro_batches

logger = logging.getLogger("ppo")

PROGRESS_KEYS = {
    "train/loss": "loss",
    "train/accuracy": "acc",
    "rm/accuracy": "val_acc",
    "rm/margin": "val_margin",
    "train/lr": "lr",
    "train/grad_norm": "gnorm",
}


def main(argv: list[str] | None = None) -> int:
    return runner.main(argv, RewardModelConfig, train, __doc__)


def train(cfg: RewardModelConfig, info: DistInfo) -> None:
    """The reward-model run: pairs, model, the loop (resumable), held-out accuracy, the saved model."""
    start = stage_loop.start_stage(
        cfg,
        info,
        functools.partial(
            stage_data.load_preference_pairs,
            max_length=cfg.data.max_length,
            apply_chat_template=cfg.data.apply_chat_template,
        ),
    )
    val_pairs = start.val or []
    skipped = {
        "train": count_rows(cfg.data.train_files) - len(start.train),
        "val": count_rows(cfg.data.val_files) - len(val_pairs),
    }
    model = model_setup.build_model(model_loading.load_reward_model, cfg.model, cfg.fsdp, info)
    trained = with_optimizer(model, cfg.optim, start.num_steps)
    logger.info(
        "reward model: world size %d on %s; %d train pairs (%d rows skipped), %d val pairs (%d skipped); "
        "%d steps of %d pairs; %.2fM parameters",
        info.world_size,
        info.device,
        len(start.train),
        skipped["train"],
        len(val_pairs),
        skipped["val"],
        start.num_steps,
        cfg.data.train_batch_size,
        models.count_parameters(model) / 1e6,
    )

    def rm_step(pairs: list[stage_data.PreferencePair]) -> tuple[dict[str, float], float]:
        """The pairwise loss averaged over every pair of the global batch (its gradient)."""
        groups = plan_micro_batches(
            [pair_length(p) for p in pairs],
            use_dynamic_bsz=cfg.data.use_dynamic_bsz,
            max_tokens=cfg.data.max_token_len_per_gpu,
            micro_batch_size=cfg.data.micro_batch_size_per_gpu,
        )
        sums = [0.0, 0.0, 0.0, float(sum(pair_length(p) for p in pairs))]  # loss, right, margin, tokens
        for group in groups:
            chosen, rejected = pair_scores(model, [pairs[i] for i in group], info.device)
            loss = bradley_terry_loss(chosen, rejected, cfg.loss.margin).sum()
            (loss / cfg.data.train_batch_size).backward()
            sums[0] += loss.item()
            sums[1] += pair_accuracy(chosen, rejected).sum().item()
            sums[2] += (chosen - rejected).sum().item()
        loss_sum, correct, margin_sum, tokens = all_reduce_scalars(sums, "sum")
        n = cfg.data.train_batch_size
        return {
            "train/loss": loss_sum / n,
            "train/accuracy": correct / n,
            "train/margin": margin_sum / n,
        }, tokens

    result = stage_loop.train_stage(
        cfg,
        info,
        start.out_dir,
        trained=trained,
        loader=start.loader,
        num_steps=start.num_steps,
        step=rm_step,
        validate=(lambda: evaluate(model, val_pairs, cfg, info)) if val_pairs else None,
        progress_keys=PROGRESS_KEYS,
    )
    result.metrics_logger.close()
    if result.stopped:
        return

    # Save the model (PPO's reward.model_path) and its held-out numbers.
    saved = models.save_model(model, start.tokenizer, run_folder.stage_save_path(cfg), info)
    final: dict[str, object] = {
        "rm_steps": result.steps,
        "rm_train_time_s": round(result.train_time_s, 1),
        "rm_train_rows_skipped": skipped["train"],
        "rm_val_rows_skipped": skipped["val"],
    }
    val_metrics = result.metrics
    if "rm/accuracy" in val_metrics:
        kinds = {
            k.removeprefix("rm/accuracy/"): v for k, v in val_metrics.items() if k.startswith("rm/accuracy/")
        }
        final.update(
            rm_val_accuracy=round(val_metrics["rm/accuracy"], 4),
            rm_val_margin=round(val_metrics["rm/margin"], 4),
            rm_val_accuracy_by_mistake={k: round(v, 4) for k, v in sorted(kinds.items())},
        )
    runner.write_final_metrics(saved.parent, info, final)


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: float = 0.0
) -> torch.Tensor:
    """Per-pair Bradley-Terry loss ``-log sigmoid(r_chosen - r_rejected - margin)``: ``[B], [B] -> [B]``.

    The negative log-likelihood that the chosen response wins under P(c > r) = sigmoid(r_c - r_r);
    a margin asks the chosen one to win by at least that much (Llama 2's reward-model loss).
    """
    return -F.logsigmoid(chosen_scores.float() - rejected_scores.float() - margin)


def pair_accuracy(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """1.0 where the chosen response is scored strictly above the rejected one, else 0.0: ``[B]``."""
    return (chosen_scores > rejected_scores).float()


def pair_length(pair: stage_data.PreferencePair) -> int:
    """Tokens a pair takes in a packed micro-batch (its chosen and its rejected sequence)."""
    return len(pair.chosen_ids) + len(pair.rejected_ids)


def pair_scores(
    model: nn.Module, pairs: list[stage_data.PreferencePair], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``[B]`` of the chosen and of the rejected sequences, from one packed forward.

    The row holds chosen_0, rejected_0, chosen_1, ...; each score is read at its sequence's last token.
    """
    seqs = [ids for p in pairs for ids in (p.chosen_ids, p.rejected_ids)]
    packed = pack_sequences(seqs, device)
    scores = models.reward_scores(
        model, packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.offsets
    )
    return scores[0::2], scores[1::2]


def count_rows(files: list[str]) -> int:
    """Rows in Parquet files (before any filtering), from their metadata."""
    return sum(pq.read_metadata(f).num_rows for f in files)


@torch.no_grad()
def evaluate(
    model: nn.Module, pairs: list[stage_data.PreferencePair], cfg: RewardModelConfig, info: DistInfo
) -> dict[str, float]:
    """Held-out ``rm/accuracy``, ``rm/margin``, ``val/loss`` and ``rm/accuracy/<mistake>``.

    Every rank scores its share; the per-kind counts are gathered once.
    """
    mine = rank_slice(pairs, info)
    counts: dict[str, list[float]] = {}  # kind -> [correct, pairs]; "" is all of them
    margin_sum = loss_sum = 0.0
    groups = plan_eval_micro_batches(
        [pair_length(p) for p in mine],
        use_dynamic_bsz=cfg.data.use_dynamic_bsz,
        max_tokens=cfg.data.max_token_len_per_gpu,
        micro_batch_size=cfg.data.micro_batch_size_per_gpu,
    )
    for group in groups:
        if not group:  # this rank is out of pairs, but the forward is a collective: join it
            dummy = pack_sequences([DUMMY_SEQUENCE], info.device)
            models.reward_scores(model, dummy.input_ids, dummy.position_ids, dummy.cu_seqlens, dummy.offsets)
            continue
        batch = [mine[i] for i in group]
        chosen, rejected = pair_scores(model, batch, info.device)
        right = pair_accuracy(chosen, rejected).tolist()
        margin_sum += (chosen - rejected).sum().item()
        loss_sum += bradley_terry_loss(chosen, rejected, cfg.loss.margin).sum().item()
        for pair, ok in zip(batch, right, strict=True):
            for kind in ("", pair.extra.get("mistake")):
                if kind is not None:
                    c = counts.setdefault(str(kind), [0.0, 0.0])
                    c[0] += ok
                    c[1] += 1
    totals: dict[str, list[float]] = {}
    margin_total = loss_total = 0.0
    for part_counts, part_margin, part_loss in all_gather_object((counts, margin_sum, loss_sum)):
        margin_total += part_margin
        loss_total += part_loss
        for kind, (ok, n) in part_counts.items():
            t = totals.setdefault(kind, [0.0, 0.0])
            t[0] += ok
            t[1] += n
    correct, num_pairs = totals.pop("", [0.0, 0.0])
    num_pairs = max(num_pairs, 1.0)
    out = {
        "rm/accuracy": correct / num_pairs,
        "rm/margin": margin_total / num_pairs,
        "val/loss": loss_total / num_pairs,
    }
    for kind, (ok, n) in sorted(totals.items()):
        out[f"rm/accuracy/{kind}"] = ok / n
    return out


if __name__ == "__main__":
    exit_process(main())
