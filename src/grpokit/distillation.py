"""On-policy distillation's loss from hidden states: the generalized JSD of `loss.distillation_loss` computed
against the student's and the teacher's LM heads chunk by chunk, and the check that both share a tokenizer.

Shapes: N completions, T completion tokens, M = tokens where the loss mask is nonzero, H_s / H_t the student's /
teacher's hidden sizes (they may differ: only the vocabulary V must match), c rows per chunk.

`chunked_distillation_loss` equals `loss.distillation_loss(hidden_s @ W_s.T + b_s, hidden_t @ W_t.T + b_t, mask)`
(TRL 1.16's `DistillationTrainer` loss, whose own kernel, `trl.kernels.chunked_divergence`, tiles the same way),
but neither model's [N, T, V] logits ever exist: the masked-in rows are projected c at a time, each chunk's
divergence and student entropy are reduced to one number per row, and the backward recomputes each chunk's logits
and turns them into the gradient of the student's hidden states and head. Peak memory is a few [c, V] float32
buffers whatever T (benchmarks/distill_memory.py). The teacher receives no gradient.

Gradient of the per-token divergence with respect to the student's tempered logits z = logits / temperature
(p_s = softmax(z), p_t the teacher's, m = (1 - beta) · p_s + beta · p_t; KL(p ‖ q) summed over V per row):

    beta = 0 (KL(p_t ‖ p_s))      p_s - p_t
    beta = 1 (KL(p_s ‖ p_t))      p_s · (log p_s - log p_t - KL(p_s ‖ p_t))
    0 < beta < 1                  (1 - beta) · p_s · (log p_s - log m - KL(p_s ‖ m))

(the last because d/dp_s of beta · KL(p_t ‖ m) + (1 - beta) · KL(p_s ‖ m) is (1 - beta) · (log p_s - log m) + a
constant, which the softmax's Jacobian removes), then divided by the temperature for the raw logits.
"""

from __future__ import annotations

import math

import torch

from .cpu_memory import return_free_memory
from .head_autograd import add_weight_grad, head_grad_accumulators, head_input_grads, save_for_head_backward
from .logprobs import _ChunkScratch, _softmax_dtype, default_chunk_rows
from .loss import DistillationStats, distillation_reduction

# ------------------------------------------------------------------------------------------------ the loss


def _head_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the plain `nn.Linear` head would multiply in: autocast's under autocast, else the inputs'."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _log_softmax_(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of a [c, V] float buffer in place; returns its log-sum-exp per row [c]."""
    log_normalizer = torch.logsumexp(logits, dim=-1)
    logits.sub_(log_normalizer[:, None])
    return log_normalizer


def _mixture_logprobs(student_logprobs, teacher_logprobs, beta: float, out: torch.Tensor) -> torch.Tensor:
    """log m = log((1 - beta) · p_s + beta · p_t), into `out` [c, V]."""
    return torch.logaddexp(student_logprobs + math.log1p(-beta), teacher_logprobs + math.log(beta), out=out)


class _ChunkedGeneralizedJSD(torch.autograd.Function):
    """Flat rows: student hidden [M, H_s], teacher hidden [M, H_t] -> divergence [M], student entropy [M].

    The forward keeps one log-sum-exp per row for each model and, for 0 < beta < 1, KL(p_s ‖ m) per row (the
    backward's centring term); the backward recomputes both models' logits chunk by chunk."""

    @staticmethod
    def forward(
        ctx,
        student_hidden,
        student_weight,
        student_bias,
        teacher_hidden,
        teacher_weight,
        teacher_bias,
        beta,
        temperature,
        chunk_rows,
        student_dtype,
        teacher_dtype,
    ):
        rows, device = student_hidden.shape[0], student_hidden.device
        out_dtype = torch.promote_types(_softmax_dtype(student_dtype), _softmax_dtype(teacher_dtype))
        divergence = torch.empty(rows, dtype=out_dtype, device=device)
        entropy = torch.empty(rows, dtype=out_dtype, device=device)
        centring = torch.empty(rows, dtype=out_dtype, device=device)  # KL(p_s ‖ m), or the divergence at the ends
        student_lse = torch.empty(rows, dtype=out_dtype, device=device)
        teacher_lse = torch.empty(rows, dtype=out_dtype, device=device)
        student_head = _Head(student_weight, student_bias, student_dtype, min(chunk_rows, rows), out_dtype)
        teacher_head = _Head(teacher_weight, teacher_bias, teacher_dtype, min(chunk_rows, rows), out_dtype)
        work = torch.empty(min(chunk_rows, rows), student_weight.shape[0], dtype=out_dtype, device=device)
        for start in range(0, rows, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            student_logprobs = student_head.logits_of(student_hidden[chunk], temperature)
            teacher_logprobs = teacher_head.logits_of(teacher_hidden[chunk], temperature)
            student_lse[chunk] = _log_softmax_(student_logprobs)
            teacher_lse[chunk] = _log_softmax_(teacher_logprobs)
            work = work[: len(student_logprobs)]
            student_probs = torch.exp(student_logprobs, out=work)
            entropy[chunk] = -(student_probs * student_logprobs).sum(-1)
            if beta == 1.0:  # KL(p_s ‖ p_t)
                divergence[chunk] = (student_probs * (student_logprobs - teacher_logprobs)).sum(-1)
                centring[chunk] = divergence[chunk]
            elif beta == 0.0:  # KL(p_t ‖ p_s)
                teacher_probs = torch.exp(teacher_logprobs, out=work)
                divergence[chunk] = (teacher_probs * (teacher_logprobs - student_logprobs)).sum(-1)
            else:
                kl_student = (student_probs * student_logprobs).sum(-1)  # minus Σ p_s log m, below
                mixture_logprobs = _mixture_logprobs(student_logprobs, teacher_logprobs, beta, out=work)
                kl_student -= (student_logprobs.exp() * mixture_logprobs).sum(-1)
                kl_teacher = (teacher_logprobs.exp() * (teacher_logprobs - mixture_logprobs)).sum(-1)
                divergence[chunk] = beta * kl_teacher + (1 - beta) * kl_student
                centring[chunk] = kl_student
        save_for_head_backward(
            ctx,
            (
                student_hidden,
                student_weight,
                student_bias,
                teacher_hidden,
                teacher_weight,
                teacher_bias,
                student_lse,
                teacher_lse,
                centring,
            ),
            entropy,
            beta=beta,
            temperature=temperature,
            chunk_rows=chunk_rows,
            student_dtype=student_dtype,
            teacher_dtype=teacher_dtype,
        )
        return divergence, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_divergence, grad_entropy):
        (
            student_hidden,
            student_weight,
            student_bias,
            teacher_hidden,
            teacher_weight,
            teacher_bias,
            student_lse,
            teacher_lse,
            centring,
        ) = ctx.saved_tensors
        if grad_divergence is None or not any(ctx.needs_input_grad[:3]):
            return (None,) * 11
        beta, temperature, chunk_rows = ctx.beta, ctx.temperature, ctx.chunk_rows
        rows, accumulate_dtype = student_hidden.shape[0], student_lse.dtype
        grad_divergence = grad_divergence.to(accumulate_dtype) / temperature  # z = logits / temperature
        (need_hidden, need_weight, need_bias), grad_hidden, grad_weight, grad_bias = head_grad_accumulators(
            ctx, student_hidden, student_weight, accumulate_dtype
        )
        student_head = _Head(student_weight, student_bias, ctx.student_dtype, min(chunk_rows, rows), accumulate_dtype)
        teacher_head = _Head(teacher_weight, teacher_bias, ctx.teacher_dtype, min(chunk_rows, rows), accumulate_dtype)
        work = torch.empty(
            min(chunk_rows, rows), student_weight.shape[0], dtype=accumulate_dtype, device=student_hidden.device
        )
        with torch.autocast(student_hidden.device.type, enabled=False):
            for start in range(0, rows, chunk_rows):
                chunk = slice(start, start + chunk_rows)
                hidden_chunk = student_hidden[chunk]
                student_logprobs = student_head.logits_of(hidden_chunk, temperature)
                teacher_logprobs = teacher_head.logits_of(teacher_hidden[chunk], temperature)
                student_logprobs.sub_(student_lse[chunk, None])
                teacher_logprobs.sub_(teacher_lse[chunk, None])
                work = work[: len(student_logprobs)]
                if beta == 0.0:  # p_s - p_t
                    grad_logits = torch.exp(student_logprobs, out=work).sub_(teacher_logprobs.exp_())
                elif beta == 1.0:  # p_s · (log p_s - log p_t - KL)
                    grad_logits = teacher_logprobs.neg_().add_(student_logprobs).sub_(centring[chunk, None])
                    grad_logits.mul_(student_logprobs.exp_())
                else:  # (1 - beta) · p_s · (log p_s - log m - KL(p_s ‖ m))
                    mixture_logprobs = _mixture_logprobs(student_logprobs, teacher_logprobs, beta, out=work)
                    grad_logits = mixture_logprobs.neg_().add_(student_logprobs).sub_(centring[chunk, None])
                    grad_logits.mul_(student_logprobs.exp_()).mul_(1 - beta)
                grad_logits.mul_(grad_divergence[chunk, None])
                if need_bias:
                    grad_bias += grad_logits.sum(0)
                grad_logits = student_head.cast(grad_logits)
                if need_hidden:
                    grad_hidden[chunk] = (grad_logits @ student_head.weight).to(student_hidden.dtype)
                if need_weight:
                    add_weight_grad(grad_weight, grad_logits, hidden_chunk.to(grad_logits.dtype))
        return head_input_grads(grad_hidden, grad_weight, grad_bias, student_weight, student_bias, num_other_inputs=8)


class _Head:
    """One model's LM head in its matmul dtype, with the [c, V] scratch its chunks' logits go into."""

    def __init__(self, weight, bias, compute_dtype, rows: int, out_dtype):
        self.weight = weight.to(compute_dtype)
        self.bias = None if bias is None else bias.to(compute_dtype)
        self.scratch = _ChunkScratch(rows, weight.shape[0], compute_dtype, weight.device, exp=False)
        if self.scratch.logits.dtype != out_dtype:  # a float32 head beside a float64 one: promote both
            self.scratch.logits = torch.empty(rows, weight.shape[0], dtype=out_dtype, device=weight.device)

    def logits_of(self, hidden_chunk, temperature: float) -> torch.Tensor:
        """(hidden_chunk @ W.T + b) / temperature, [c, V] float32 (float64 for float64), in the scratch."""
        return self.scratch.logits_of(hidden_chunk, self.weight, self.bias, temperature)

    def cast(self, chunk: torch.Tensor) -> torch.Tensor:
        """A float32 chunk in the matmul dtype (for the gradient's matmuls)."""
        return self.scratch.cast(chunk)


def chunked_distillation_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, DistillationStats]:
    """`loss.distillation_loss` of the logits `hidden @ weight.T + bias` of both models, without their logits.

    student_hidden: [N, T, H_s], the student's final hidden states (the LM head's input) at the completion tokens
    student_weight: [V, H_s] its LM head (student_bias: [V] or None)
    teacher_hidden: [N, T, H_t], teacher_weight: [V, H_t] (teacher_bias: [V] or None), the same for the teacher
    mask: [N, T], nonzero where the loss applies (completion_mask · tool_mask)
    beta, temperature, num_tokens: as in `loss.distillation_loss` (0 forward KL, 0.5 JSD, 1 reverse KL)
    chunk_rows: rows per chunk; default `logprobs.default_chunk_rows` of the student's head

    Each model's matmul runs in the dtype its plain head would (autocast's, else its inputs'), so a bf16 teacher
    beside a float32 student is fine; the softmaxes, divergences and gradients are float32 (float64 for float64).
    Heads that transform their logits (soft-capping, logit scales) are not covered: the caller refuses them, as
    the chunked log-prob path does (`logprobs.LOGIT_TRANSFORM_FIELDS`).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 0.5 = JSD, 1 = reverse KL), got {beta}.")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"The student's LM head has {student_weight.shape[0]} rows and the teacher's {teacher_weight.shape[0]}: "
            "the divergence compares the two distributions entry by entry, so both heads must cover the same "
            "vocabulary. If one head is padded past the tokenizer (e.g. Qwen2.5 0.5B's 151,936 rows against 7B's "
            "152,064), slice both to the same rows first."
        )
    valid = mask.reshape(-1) != 0
    student_rows = student_hidden.reshape(-1, student_hidden.shape[-1])[valid]  # [M, H_s]
    teacher_rows = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])[valid].detach()  # [M, H_t]
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(student_weight, student_bias)
    if student_rows.device.type == "cpu":  # the decoders' freed activations, which the [c, V] buffers would stack on
        return_free_memory()
    student_dtype = _head_dtype(student_rows, student_weight)
    teacher_dtype = _head_dtype(teacher_rows, teacher_weight)
    with torch.autocast(student_rows.device.type, enabled=False):
        per_token, entropy = _ChunkedGeneralizedJSD.apply(
            student_rows,
            student_weight,
            student_bias,
            teacher_rows,
            teacher_weight.detach(),
            None if teacher_bias is None else teacher_bias.detach(),
            float(beta),
            float(temperature),
            max(1, int(chunk_rows)),
            student_dtype,
            teacher_dtype,
        )
    num_valid = valid.sum()
    return distillation_reduction(per_token, num_valid, num_tokens), DistillationStats(entropy.sum(), num_valid)


# ------------------------------------------------------------------------------------------ the tokenizers


def _first(items, count: int = 5) -> str:
    items = sorted(items, key=repr)
    shown = ", ".join(repr(item) for item in items[:count])
    return shown + (f" and {len(items) - count} more" if len(items) > count else "")


def _tokens(count: int) -> str:
    return f"{count} token" if count == 1 else f"{count} tokens"


def tokenizer_differences(student_tokenizer, teacher_tokenizer) -> list[str]:
    """What keeps the teacher from scoring the student's token ids: one line per difference. Empty when they agree.

    Scoring needs two things: every token of the student's tokenizer (added tokens included) has its id in the
    teacher's, so that the teacher reads each id the student emits as the same token; and both end on the same
    end-of-sequence id (the completion's last scored token). Nothing else is compared: tokens only the teacher's
    tokenizer has are ids the student's tokenizer gives no meaning (`AutoTokenizer` adds its class's default unk
    token, e.g. Qwen2's '<|endoftext|>', to a tokenizer saved without one, so a teacher folder holding the
    student's very tokenizer reloads one token longer); the padding token takes no part in the loss (trainers set
    a missing one to the end-of-sequence token, as TRL does); bos / unk tokens and which tokens are special change
    how text is tokenized, not how ids are scored.
    """
    differences = []
    student_vocab, teacher_vocab = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    missing = student_vocab.keys() - teacher_vocab.keys()
    moved = {token for token in student_vocab.keys() - missing if student_vocab[token] != teacher_vocab[token]}
    if (missing or moved) and len(student_vocab) != len(teacher_vocab):
        differences.append(
            f"the student's vocabulary has {len(student_vocab)} tokens, the teacher's {len(teacher_vocab)}"
        )
    if missing:
        differences.append(f"{_tokens(len(missing))} only in the student's: {_first(missing)}")
    if moved:
        examples = _first(f"{token} -> {student_vocab[token]} / {teacher_vocab[token]}" for token in moved)
        differences.append(f"{_tokens(len(moved))} with other ids (student / teacher): {examples}")
    student_eos, teacher_eos = student_tokenizer.eos_token_id, teacher_tokenizer.eos_token_id
    if student_eos != teacher_eos:
        differences.append(
            f"eos_token: {student_tokenizer.eos_token!r} (id {student_eos}) in the student's, "
            f"{teacher_tokenizer.eos_token!r} (id {teacher_eos}) in the teacher's"
        )
    return differences


def check_shared_tokenizer(student_tokenizer, teacher_tokenizer) -> None:
    """Refuse a teacher whose tokenizer differs from the student's.

    The teacher scores the student's own token ids, and the divergence compares the two next-token distributions
    entry by entry, so the teacher must give every token of the student's the same id and end on the same
    end-of-sequence id (`tokenizer_differences`). Models of one family share a tokenizer even when their
    architectures, sizes or dtypes differ; that is all this requires.
    """
    differences = tokenizer_differences(student_tokenizer, teacher_tokenizer)
    if differences:
        raise ValueError(
            "The teacher's tokenizer differs from the student's: " + "; ".join(differences) + ". On-policy "
            "distillation needs one tokenizer for both models: pick a teacher of the student's family (same "
            "tokenizer, any size or dtype), or pass as `processing_class` the tokenizer both were trained with. "
            "Distilling across tokenizers (TRL's experimental GOLD trainer) is not supported."
        )
