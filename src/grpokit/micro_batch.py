"""The GRPO loss of one micro-batch under the policy (`micro_batch_loss`, what GRPOTrainer.compute_loss runs for
each): the training forward (token log-probs and entropies), the tokens the loss keeps (top_entropy_quantile), the
policy loss (`loss.policy_loss`, where the math is), and what joins it: the adaptive entropy bonus's observation and
MoE load balancing. The counts that normalise it are the whole optimizer step's window's, given by the caller."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from .batch import TrainBatch
from .config import GRPOConfig
from .logprobs import token_logprobs
from .loss import AdaptiveEntropyController, high_entropy_mask, load_balancing_loss, logprob_gap, policy_loss
from .served import SERVED_GAP, SERVED_TOTALS, gap_totals


def window_counts(accelerator, window: list[TrainBatch]) -> tuple[float, float, int]:
    """(sequences, tokens, micro-batches) of an optimizer step's window, the `counts` that normalise each of its
    micro-batches' loss: over all its micro-batches and all processes, divided by the number of processes (DDP
    averages gradients over processes, so each process's share is multiplied back)."""
    local = [sum(len(b) for b in window), sum(b.loss_mask.sum().item() for b in window)]
    totals = accelerator.reduce(torch.tensor(local, dtype=torch.float64, device=accelerator.device), "sum")
    num_sequences, num_tokens = (totals / accelerator.num_processes).tolist()
    return num_sequences, num_tokens, len(window)


def micro_batch_loss(
    model: torch.nn.Module,
    batch: TrainBatch,
    counts: tuple[float, float, int],
    args: GRPOConfig,
    autocast: Callable[[], AbstractContextManager],
    *,
    entropy_controller: AdaptiveEntropyController | None = None,
    router_aux_loss_coef: float = 0.0,
    moe: tuple[int, int] | None = None,
    offload: AbstractContextManager | None = None,
) -> tuple[torch.Tensor, dict]:
    """`batch`'s loss under `model`, and its stats (`LossStats.as_dict`; `aux_loss` with MoE load balancing).

    counts: (sequences, tokens, micro-batches) of the optimizer step's window. entropy_controller:
    use_adaptive_entropy's, which sets the bonus's coefficient and observes the entropies. router_aux_loss_coef and
    moe (experts, experts per token): MoE load balancing, per optimizer step. offload: what the forward saves waits
    in host memory (activation offloading)."""
    num_sequences, num_tokens, num_micro_batches = counts
    controller = entropy_controller
    entropy_coef = controller.coef_to_apply() if controller is not None else args.entropy_coef
    router_logits = [] if router_aux_loss_coef else None
    # With a sampling mask the ratio's log-probs are the kept sets'; the KL to the reference keeps the full
    # vocabulary's (TRL's KL term), which the forward then returns too.
    full_vocabulary = [] if batch.sampling_mask is not None and batch.ref_logprobs is not None else None
    with autocast(), offload or contextlib.nullcontext():
        logprobs, entropies = token_logprobs(
            model,
            batch.input_ids,
            batch.input_mask,
            batch.completion_ids.shape[1],
            args.temperature,
            with_entropy=True,
            entropy_grad=args.entropy_coef != 0 or controller is not None,
            router_logits=router_logits,
            fp32_head=args.cast_lm_head_to_fp32,
            multimodal=batch.multimodal,
            padding_free=args.padding_free,
            sampling_mask=batch.sampling_mask,
            full_vocabulary=full_vocabulary,
        )
    loss_weights = None
    if args.top_entropy_quantile < 1.0:
        loss_weights = high_entropy_mask(entropies.detach(), batch.loss_mask, args.top_entropy_quantile)
    loss, stats = policy_loss(
        logprobs,
        batch.old_logprobs,
        batch.ref_logprobs,
        batch.advantages,
        batch.loss_mask,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        entropies=entropies,
        entropy_coef=entropy_coef,
        loss_weights=loss_weights,
        sampling_logprobs=batch.sampling_logprobs,
        sampling_ratio=batch.sampling_ratio,
        kl_logprobs=full_vocabulary[0] if full_vocabulary else None,
        num_micro_batches=num_micro_batches,
        entropy_normalization="token_mean",
        **args.objective_options(),
    )
    if controller is not None:
        mask = batch.loss_mask if loss_weights is None else batch.loss_mask * loss_weights
        controller.observe(entropies.detach(), mask)
    if router_logits is not None:
        aux = load_balancing_loss(router_logits, *moe, batch.input_mask).to(loss.device)
        loss = loss + router_aux_loss_coef * aux / num_micro_batches
        stats.objective["aux_loss"] = aux.detach()
    step_stats = stats.as_dict()
    if batch.served_rows is not None and batch.sampling_logprobs is not None:  # π_old is this forward (served.py)
        served = batch.loss_mask * batch.served_rows[:, None].to(batch.loss_mask.dtype)
        step_stats[SERVED_GAP] = logprob_gap(logprobs, batch.sampling_logprobs, served)[SERVED_GAP].item()
        if batch.sampler is not None:  # each sampler's own (several servers, a data-parallel one's engines)
            step_stats[SERVED_TOTALS] = gap_totals(logprobs.detach(), batch.sampling_logprobs, served, batch.sampler)
    return loss, step_stats
