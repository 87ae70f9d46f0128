"""The DPO family's losses on preference pairs: DPO (and cDPO), IPO, SimPO and KTO.

One value per pair, shape ``[P]``: the caller sums them and divides by the number of pairs of the whole
step (all ranks, all micro-batches), so gradient accumulation and data parallelism are exact. The
inputs are per-pair sequence quantities of the chosen (``w``) and rejected (``l``) response:

- ``*_logratios``: ``log π(y|x) − log π_ref(y|x)`` with each log-prob summed over the response tokens
  (EOS included), the policy's with gradients, the reference's without (TRL's ``ipo`` passes them
  divided by the response's token count instead);
- ``*_mean_logps`` (SimPO): ``log π(y|x) / |y|``, the policy's token-mean log-prob (no reference).

    chosen_logratios = policy_chosen_logps - ref_chosen_logps          # [P]
    losses = dpo_loss(chosen_logratios, rejected_logratios, beta=0.1)   # [P]
    (losses.sum() / num_pairs).backward()
"""

import torch
import torch.nn.functional as F


def dpo_loss(
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """DPO (Rafailov et al. 2023), with label smoothing cDPO (Mitchell 2023): ``[P], [P] -> [P]``.

    With ``h = β (logr_w − logr_l)`` and ``ε = label_smoothing`` (the assumed share of flipped labels)::

        loss = −(1 − ε) log σ(h) − ε log σ(−h)

    At ``π = π_ref`` every pair's loss is ``log 2`` whatever ``ε``; its gradient with respect to
    ``h`` is ``−(1 − ε) σ(−h) + ε σ(h)``, ``−1/2 + ε`` there.
    """
    h = beta * (chosen_logratios.float() - rejected_logratios.float())
    return -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


def ipo_loss(
    chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, *, beta: float
) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17): ``((logr_w − logr_l) − 1/(2β))²``, ``[P], [P] -> [P]``.

    A squared loss that pulls the log-ratio margin to ``1/(2β)`` instead of pushing it to infinity; at
    ``π = π_ref`` it is ``(1/(2β))²`` (25 at ``β = 0.1``). Its target depends on what the log-ratios
    are: sums over the response's tokens (the paper; ``loss.type=ipo_sum``) ask for a margin of 5 nats
    per response at ``β = 0.1``; token means (TRL's ``loss_type="ipo"``; ``loss.type=ipo``) ask for 5
    nats per token.
    """
    margin = chosen_logratios.float() - rejected_logratios.float()
    return (margin - 1.0 / (2.0 * beta)) ** 2


def simpo_loss(
    chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor, *, beta: float, gamma: float
) -> torch.Tensor:
    """SimPO (Meng et al. 2024), reference-free and length-normalized: ``[P], [P] -> [P]``.

    ``loss = −log σ(β (log π(y_w)/|y_w| − log π(y_l)/|y_l|) − γ)``: the implicit reward of a response is
    ``β`` times its token-mean log-prob, and the chosen one must win by the margin ``γ``.
    """
    h = beta * (chosen_mean_logps.float() - rejected_mean_logps.float()) - gamma
    return -F.logsigmoid(h)


def kto_loss(
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
    kl: torch.Tensor | float,
    *,
    beta: float,
) -> torch.Tensor:
    """KTO (Ethayarajh et al. 2024) on a pair's chosen (desirable) and rejected (undesirable) response,
    both weighted 1: ``[P], [P], scalar -> [P]``.

    With the reference point ``z = max(kl, 0)`` (no gradient; the batch's estimate of
    ``KL(π || π_ref)``, from responses paired with other prompts, as TRL estimates it)::

        loss = ((1 − σ(β (logr_w − z))) + (1 − σ(β (z − logr_l)))) / 2

    the mean of the desirable and the undesirable response's losses, so that averaging over pairs
    averages over the ``2P`` responses. At ``π = π_ref`` (``z = 0``) it is ``1/2``.
    """
    z = torch.as_tensor(kl, dtype=torch.float32, device=chosen_logratios.device).detach().clamp(min=0.0)
    desirable = 1.0 - torch.sigmoid(beta * (chosen_logratios.float() - z))
    undesirable = 1.0 - torch.sigmoid(beta * (z - rejected_logratios.float()))
    return 0.5 * (desirable + undesirable)
