"""On-policy distillation's loss: `loss.generalized_jsd` / `loss.distillation_loss` against hand-computed numbers
and against TRL 1.16's own `DistillationTrainer` loss, and the chunked twin (`distillation.chunked_distillation_loss`)
against the full-logits computation it replaces.

Hand values are written out from the definitions with Python's `math`; nothing is computed by calling the code
under test a second way.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.distillation import check_shared_tokenizer, chunked_distillation_loss, tokenizer_differences
from grpokit.loss import distillation_loss, generalized_jsd
from grpokit.testing import build_char_tokenizer

F64 = torch.float64
ATOL = 1e-12  # float64 hand checks
ATOL_TRL = 1e-5  # float32 against TRL's kernel


def close(actual, expected, atol=ATOL):
    actual = torch.as_tensor(actual, dtype=F64)
    expected = torch.as_tensor(expected, dtype=F64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=atol, rtol=0), f"\nactual   {actual}\nexpected {expected}"


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def hand_jsd(p_student, p_teacher, beta):
    if beta == 0:
        return kl(p_teacher, p_student)
    if beta == 1:
        return kl(p_student, p_teacher)
    m = [(1 - beta) * s + beta * t for s, t in zip(p_student, p_teacher)]
    return beta * kl(p_teacher, m) + (1 - beta) * kl(p_student, m)


# ------------------------------------------------------------------------------------- hand-computed values

# The docstring's worked example: p_s = (1/2, 1/2), p_t = (3/4, 1/4).
WORKED = {
    0.0: 0.75 * math.log(1.5) + 0.25 * math.log(0.5),  # KL(p_t ‖ p_s)
    1.0: 0.5 * math.log(2 / 3) + 0.5 * math.log(2),  # KL(p_s ‖ p_t)
    0.5: 0.5 * (0.75 * math.log(6 / 5) + 0.25 * math.log(2 / 3))  # m = (5/8, 3/8)
    + 0.5 * (0.5 * math.log(4 / 5) + 0.5 * math.log(4 / 3)),
}


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_worked_example(beta):
    student = torch.tensor([0.0, 0.0], dtype=F64)
    teacher = torch.tensor([math.log(3.0), 0.0], dtype=F64)  # softmax = (3/4, 1/4)
    close(generalized_jsd(student, teacher, beta=beta), WORKED[beta])


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_temperature_divides_both_models_logits(beta):
    # At temperature 2 the teacher's logits (2 ln 3, 0) give the same (3/4, 1/4): same values as the worked example
    student = torch.tensor([5.0, 5.0], dtype=F64)
    teacher = torch.tensor([2 * math.log(3.0), 0.0], dtype=F64)
    close(generalized_jsd(student, teacher, beta=beta, temperature=2.0), WORKED[beta])


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
def test_three_way_rows_against_the_definition(beta):
    p_student = [[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]]
    p_teacher = [[0.1, 0.1, 0.8], [0.25, 0.5, 0.25]]
    student = torch.tensor(p_student, dtype=F64).log() + 1.7  # a shift per row changes nothing
    teacher = torch.tensor(p_teacher, dtype=F64).log() - 0.4
    expected = [hand_jsd(s, t, beta) for s, t in zip(p_student, p_teacher)]
    close(generalized_jsd(student, teacher, beta=beta), expected)


def test_which_end_is_which():
    # TRL 1.16's names: beta = 0 "forward KL" KL(teacher ‖ student), beta = 1 "reverse KL" KL(student ‖ teacher)
    p_student, p_teacher = [0.9, 0.05, 0.05], [0.4, 0.3, 0.3]
    student, teacher = torch.tensor(p_student, dtype=F64).log(), torch.tensor(p_teacher, dtype=F64).log()
    close(generalized_jsd(student, teacher, beta=0.0), kl(p_teacher, p_student))
    close(generalized_jsd(student, teacher, beta=1.0), kl(p_student, p_teacher))
    assert abs(kl(p_teacher, p_student) - kl(p_student, p_teacher)) > 0.1  # the two really differ here


def test_middle_tends_to_beta_times_the_ends_kl():
    # The ends are special cases, not limits: near 0 the JSD is ~ beta · KL(p_t ‖ p_s), near 1 it is
    # ~ (1 - beta) · KL(p_s ‖ p_t)
    student = torch.tensor([0.3, -1.0, 2.0], dtype=F64)
    teacher = torch.tensor([1.0, 0.5, -0.5], dtype=F64)
    small = 1e-6
    close(generalized_jsd(student, teacher, beta=small) / small, generalized_jsd(student, teacher, beta=0.0), 1e-5)
    close(generalized_jsd(student, teacher, beta=1 - small) / small, generalized_jsd(student, teacher, beta=1.0), 1e-5)


def test_jsd_is_symmetric_at_one_half():
    student = torch.tensor([[0.3, -1.0, 2.0]], dtype=F64)
    teacher = torch.tensor([[1.0, 0.5, -0.5]], dtype=F64)
    close(generalized_jsd(student, teacher, beta=0.5), generalized_jsd(teacher, student, beta=0.5))


def test_beta_outside_the_unit_interval_is_refused():
    with pytest.raises(ValueError, match="0 = forward KL"):
        generalized_jsd(torch.zeros(2), torch.zeros(2), beta=1.5)


# ------------------------------------------------------------------------------------------------ reduction


# N = 2, T = 3, V = 2: token (i, t) has the student at p_s = (1/2, 1/2) and the teacher at (3/4, 1/4) or (1/2, 1/2)
# (divergence 0). The mask drops (0, 2) — a tool span, whose logits are NaN so that a leak shows — and (1, 1).
def reduction_fixture():
    student = torch.zeros(2, 3, 2, dtype=F64)
    teacher = torch.zeros(2, 3, 2, dtype=F64)
    teacher[0, 0, 0] = teacher[1, 2, 0] = math.log(3.0)  # the two tokens with divergence WORKED[beta]
    student[0, 2] = teacher[0, 2] = float("nan")
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    return student.requires_grad_(), teacher, mask


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_masked_token_mean_over_this_calls_tokens(beta):
    student, teacher, mask = reduction_fixture()
    loss, stats = distillation_loss(student, teacher, mask, beta=beta)
    close(loss, 2 * WORKED[beta] / 4)  # two tokens with divergence, four in the mask
    close(stats.num_tokens, 4)
    close(stats.entropy_sum, 4 * math.log(2))  # the student is uniform over two entries at each token
    assert stats.as_dict() == pytest.approx({"entropy": math.log(2)})
    (grad,) = torch.autograd.grad(loss, student)
    assert torch.isfinite(grad).all()
    assert (grad[0, 2] == 0).all() and (grad[1, 1] == 0).all()


def test_num_tokens_is_the_accumulated_batchs_count():
    student, teacher, mask = reduction_fixture()
    loss, _ = distillation_loss(student, teacher, mask, beta=1.0, num_tokens=10)
    close(loss, 2 * WORKED[1.0] / 10)
    loss, _ = distillation_loss(student, teacher, mask, beta=1.0, num_tokens=torch.tensor(10.0))
    close(loss, 2 * WORKED[1.0] / 10)


def test_all_masked_gives_zero_not_nan():
    student, teacher, _ = reduction_fixture()
    loss, stats = distillation_loss(student, teacher, torch.zeros(2, 3), beta=0.5)
    assert loss.item() == 0.0 and stats.num_tokens.item() == 0 and stats.as_dict() == {"entropy": 0.0}
    loss.backward()
    assert (student.grad == 0).all()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_teacher_equal_to_student_gives_zero_loss_and_gradient(beta):
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])
    loss, _ = distillation_loss(logits, logits.detach().clone(), mask, beta=beta, temperature=0.8)
    (grad,) = torch.autograd.grad(loss, logits)
    close(loss, 0.0)
    close(grad, torch.zeros_like(grad))


# --------------------------------------------------------------------------------- TRL 1.16's own loss


def trl_loss():
    """TRL 1.16's `DistillationTrainer` loss: `_chunked_divergence_loss` (hidden states and LM heads; on a CPU its
    kernel runs the torch tiles), what `DistillationTrainer._compute_loss` calls."""
    module = pytest.importorskip("trl.trainer.distillation_trainer")
    return module._chunked_divergence_loss


def heads_fixture(dtype=torch.float32, seed=0):
    """N = 3, T = 5, V = 37; the teacher is wider (H = 12) than the student (H = 8). Row 1 has a masked tool span
    (tokens 1-2), row 2 ends in padding."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    student_hidden, student_weight = randn(3, 5, 8), randn(37, 8, scale=0.7)
    teacher_hidden, teacher_weight = randn(3, 5, 12), randn(37, 12, scale=0.7)
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    tool_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 1, 1], [1, 1, 1, 1, 1]])
    return (
        student_hidden.requires_grad_(),
        student_weight.requires_grad_(),
        teacher_hidden,
        teacher_weight,
        completion_mask * tool_mask,
    )


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("num_tokens", [None, 17])
def test_equals_trls_distillation_loss_and_its_gradient(beta, temperature, num_tokens):
    trl_chunked_divergence_loss = trl_loss()
    student_hidden, student_weight, teacher_hidden, teacher_weight, mask = heads_fixture()
    expected, expected_entropy_sum, expected_count = trl_chunked_divergence_loss(
        student_hidden,
        teacher_hidden,
        student_weight,
        teacher_weight,
        mask,
        beta,
        num_items_in_batch=num_tokens,
        temperature=temperature,
    )
    expected_grads = torch.autograd.grad(expected, (student_hidden, student_weight))

    # grpokit on full logits (the naive path) and on the heads (the chunked path, several chunk sizes)
    loss, stats = distillation_loss(
        student_hidden @ student_weight.T,
        teacher_hidden @ teacher_weight.T,
        mask,
        beta=beta,
        temperature=temperature,
        num_tokens=num_tokens,
    )
    grads = torch.autograd.grad(loss, (student_hidden, student_weight))
    close(loss, expected, ATOL_TRL)
    for grad, expected_grad in zip(grads, expected_grads):
        close(grad, expected_grad, ATOL_TRL)
    close(stats.entropy_sum, expected_entropy_sum, ATOL_TRL)
    assert stats.num_tokens.item() == expected_count.item() == 11
    for chunk_rows in (4, None):
        loss, stats = chunked_distillation_loss(
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            mask,
            beta=beta,
            temperature=temperature,
            num_tokens=num_tokens,
            chunk_rows=chunk_rows,
        )
        grads = torch.autograd.grad(loss, (student_hidden, student_weight))
        close(loss, expected, ATOL_TRL)
        for grad, expected_grad in zip(grads, expected_grads):
            close(grad, expected_grad, ATOL_TRL)
        close(stats.entropy_sum, expected_entropy_sum, ATOL_TRL)


# ------------------------------------------------------------------------------ the chunked twin (naive = full)


def naive(
    student_hidden, student_weight, teacher_hidden, teacher_weight, mask, student_bias=None, teacher_bias=None, **kwargs
):
    student_logits = student_hidden @ student_weight.T
    teacher_logits = teacher_hidden @ teacher_weight.T
    if student_bias is not None:
        student_logits = student_logits + student_bias
    if teacher_bias is not None:
        teacher_logits = teacher_logits + teacher_bias
    return distillation_loss(student_logits, teacher_logits, mask, **kwargs)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("chunk_rows", [1, 3, 64])
def test_chunked_equals_full_logits_in_float64(beta, chunk_rows):
    student_hidden, student_weight, teacher_hidden, teacher_weight, mask = heads_fixture(F64, seed=1)
    student_bias = torch.randn(37, dtype=F64, requires_grad=True)
    teacher_bias = torch.randn(37, dtype=F64)
    inputs = (student_hidden, student_weight, teacher_hidden, teacher_weight, mask)
    options = {"beta": beta, "temperature": 0.9, "num_tokens": 20}
    expected, expected_stats = naive(*inputs, student_bias=student_bias, teacher_bias=teacher_bias, **options)
    loss, stats = chunked_distillation_loss(
        *inputs, student_bias=student_bias, teacher_bias=teacher_bias, chunk_rows=chunk_rows, **options
    )
    assert loss.dtype == F64
    close(loss, expected)
    close(stats.entropy_sum, expected_stats.entropy_sum)
    parameters = (student_hidden, student_weight, student_bias)
    for grad, expected_grad in zip(torch.autograd.grad(loss, parameters), torch.autograd.grad(expected, parameters)):
        close(grad, expected_grad)


def test_chunked_hidden_gradient_alone_and_teacher_gets_none():
    student_hidden, student_weight, teacher_hidden, teacher_weight, mask = heads_fixture(F64, seed=2)
    student_weight.requires_grad_(False)
    teacher_hidden.requires_grad_()
    teacher_weight.requires_grad_()
    inputs = (student_hidden, student_weight, teacher_hidden, teacher_weight, mask)
    loss, _ = chunked_distillation_loss(*inputs, beta=0.5, chunk_rows=2)
    expected, _ = naive(
        student_hidden, student_weight, teacher_hidden.detach(), teacher_weight.detach(), mask, beta=0.5
    )
    loss.backward()
    close(student_hidden.grad, torch.autograd.grad(expected, student_hidden)[0])
    assert teacher_hidden.grad is None and teacher_weight.grad is None


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_teacher_equal_to_student_gives_zero_loss_and_gradient(beta):
    student_hidden, student_weight, _, _, mask = heads_fixture(F64, seed=3)
    loss, _ = chunked_distillation_loss(
        student_hidden, student_weight, student_hidden.detach(), student_weight.detach(), mask, beta=beta, chunk_rows=4
    )
    grads = torch.autograd.grad(loss, (student_hidden, student_weight))
    close(loss, 0.0)
    for grad in grads:
        close(grad, torch.zeros_like(grad))


def test_chunked_bfloat16_teacher_beside_a_float32_student():
    # The teacher's matmul runs in its own dtype (bf16 here, as its plain head would); the softmaxes in float32
    student_hidden, student_weight, teacher_hidden, teacher_weight, mask = heads_fixture(seed=4)
    teacher_hidden, teacher_weight = teacher_hidden.bfloat16(), teacher_weight.bfloat16()
    loss, _ = chunked_distillation_loss(
        student_hidden, student_weight, teacher_hidden, teacher_weight, mask, beta=1.0, chunk_rows=4
    )
    expected, _ = distillation_loss(
        student_hidden @ student_weight.T, (teacher_hidden @ teacher_weight.T).float(), mask, beta=1.0
    )
    assert loss.dtype == torch.float32
    close(loss, expected, 1e-5)
    close(torch.autograd.grad(loss, student_hidden)[0], torch.autograd.grad(expected, student_hidden)[0], 1e-5)


def test_chunked_under_bfloat16_autocast_multiplies_as_the_plain_heads_do():
    # Under autocast both heads' matmuls run in bf16 (the product rounded to bf16, as nn.Linear's would be), and
    # everything after them in float32
    student_hidden, student_weight, teacher_hidden, teacher_weight, mask = heads_fixture(seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = chunked_distillation_loss(
            student_hidden, student_weight, teacher_hidden, teacher_weight, mask, beta=0.5, chunk_rows=4
        )
        student_logits, teacher_logits = student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T
    assert student_logits.dtype == torch.bfloat16
    expected, _ = distillation_loss(student_logits.float(), teacher_logits.float(), mask, beta=0.5)
    assert loss.dtype == torch.float32
    close(loss, expected, 1e-5)
    for grad, expected_grad in zip(
        torch.autograd.grad(loss, (student_hidden, student_weight)),
        torch.autograd.grad(expected, (student_hidden, student_weight)),
    ):
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, expected_grad, atol=2e-2, rtol=2e-2)


def test_chunked_all_masked_gives_zero():
    student_hidden, student_weight, teacher_hidden, teacher_weight, mask = heads_fixture(F64)
    loss, stats = chunked_distillation_loss(
        student_hidden, student_weight, teacher_hidden, teacher_weight, torch.zeros_like(mask), beta=0.5
    )
    loss.backward()
    assert loss.item() == 0.0 and stats.num_tokens.item() == 0
    assert (student_hidden.grad == 0).all() and (student_weight.grad == 0).all()


def test_chunked_saves_no_tensor_that_spans_the_vocabulary():
    # M = 1,024 masked-in rows, V = 32,000: [M, V] would be 33M floats; the backward works from hidden states,
    # heads and a few numbers per row
    rows, vocab, saved = 1024, 32_000, []
    student_hidden = torch.randn(4, rows // 4, 8, requires_grad=True)
    student_weight = torch.randn(vocab, 8, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(4, rows // 4, 16), torch.randn(vocab, 16)

    def pack(tensor):
        if tensor.data_ptr() not in (student_weight.data_ptr(), teacher_weight.data_ptr()):
            saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss, _ = chunked_distillation_loss(
            student_hidden, student_weight, teacher_hidden, teacher_weight, torch.ones(4, rows // 4), beta=0.5
        )
    assert saved and max(saved) < rows * vocab // 1000, saved
    loss.backward()
    assert student_hidden.grad.shape == student_hidden.shape and student_weight.grad.shape == student_weight.shape


def test_chunked_refuses_heads_of_different_vocabularies():
    student_hidden, student_weight, teacher_hidden, teacher_weight, mask = heads_fixture()
    with pytest.raises(ValueError, match="same vocabulary"):
        chunked_distillation_loss(student_hidden, student_weight, teacher_hidden, teacher_weight[:-1], mask, beta=1.0)


# ------------------------------------------------------------------------------------------- the tokenizers


def permuted_tokenizer():
    """`build_char_tokenizer()`'s tokens with the ids of 'a' and 'b' swapped: same tokens, another mapping."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = build_char_tokenizer()
    state = tokenizer.backend_tokenizer.to_str()
    vocab = tokenizer.get_vocab()
    a, b = vocab["a"], vocab["b"]
    swapped = state.replace(f'"a":{a}', '"a":SWAP').replace(f'"b":{b}', f'"b":{a}').replace('"a":SWAP', f'"a":{b}')
    assert swapped != state
    from tokenizers import Tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(swapped),
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<pad>",
    )


def test_same_tokenizer_passes():
    student, teacher = build_char_tokenizer(), build_char_tokenizer()
    assert tokenizer_differences(student, teacher) == []
    check_shared_tokenizer(student, teacher)


def test_a_missing_padding_token_is_no_difference():
    # Trainers set a missing pad token to eos; padded positions take no part in the loss
    teacher = build_char_tokenizer()
    teacher.pad_token = None
    check_shared_tokenizer(build_char_tokenizer(), teacher)


def test_another_vocabulary_is_refused_naming_the_tokens_and_the_fix():
    student, teacher = build_char_tokenizer(), build_char_tokenizer("abc")
    with pytest.raises(ValueError) as refusal:
        check_shared_tokenizer(student, teacher)
    message = str(refusal.value)
    assert "the student's vocabulary has 53 tokens, the teacher's 10" in message
    assert "43 tokens only in the student's: ' ', '+'" in message
    assert "tokens with other ids (student / teacher): 'a -> 27 / 7'" in message
    assert "pick a teacher of the student's family" in message and "processing_class" in message


def test_the_same_tokens_under_other_ids_are_refused():
    differences = tokenizer_differences(build_char_tokenizer(), permuted_tokenizer())
    assert differences == ["2 tokens with other ids (student / teacher): 'a -> 27 / 28', 'b -> 28 / 27'"]


def test_another_end_of_sequence_token_is_refused():
    teacher = build_char_tokenizer()
    teacher.eos_token = "<|end|>"
    assert tokenizer_differences(build_char_tokenizer(), teacher) == [
        "eos_token: '<eos>' (id 1) in the student's, '<|end|>' (id 6) in the teacher's"
    ]


def test_a_token_only_the_student_has_is_refused():
    student = build_char_tokenizer()
    student.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    with pytest.raises(
        ValueError,
        match="the student's vocabulary has 54 tokens, the teacher's 53; 1 token only in the student's: '<tool>'",
    ):
        check_shared_tokenizer(student, build_char_tokenizer())


def test_tokens_only_the_teacher_has_and_its_other_special_tokens_are_no_difference():
    # What AutoTokenizer does to a tokenizer saved without an unk token under a class that has a default one: the
    # default is added after the last id and made the unk token. The student never reads those ids.
    teacher = build_char_tokenizer()
    teacher.add_special_tokens({"unk_token": "<|endoftext|>", "additional_special_tokens": ["<tool>"]})
    assert len(teacher) == len(build_char_tokenizer()) + 2
    assert tokenizer_differences(build_char_tokenizer(), teacher) == []
