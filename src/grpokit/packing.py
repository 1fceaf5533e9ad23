"""Padding-free (packed) training forwards: the real tokens of a micro-batch in a few packed rows, no padding.

A GRPO micro-batch holds rows [prompt (left-padded) | completion (right-padded)] whose completions end anywhere
between 0 and T tokens. The padded forward runs all N·(P + T) positions. A packed forward runs each distinct prompt
once per *segment*, followed by the completions of its rows ("prefix-shared packing"):

    packed row:  [ prompt a | completion a1 | completion a2 | prompt b | completion b1 ] [filler]

with a custom attention mask: a completion token attends to its own prompt's real tokens and to its own earlier
real tokens, nothing else; a prompt token attends causally within its prompt. Position ids are the padded forward's
(a completion continues from its prompt's length), so every real token sees exactly the keys, values and positions
it sees in the padded forward, and its hidden state is the same up to float rounding.

Only the tokens whose hidden state predicts a completion token run: the prompt from its first real token on (its
last position predicts the first completion token) and each completion but its last real token. A completion
padded in the middle (a hole) keeps its hole as a token that no other token attends to, as in the padded forward.

Segments are packed into rows of at most `row_tokens` positions (first-fit, longest first); a prompt whose
completions do not fit in one row is repeated in the next (as the padded forward repeats it in every row). Rows are
bounded rather than one [1, M] sequence because SDPA with a mask does the work of every (query, key) pair, masked
or not (CPU, torch 2.13, 14 heads of 64: one 4,096-token row with a block-diagonal mask took 20x the forward time
and 14x the forward + backward time of the same tokens as 16 rows of 256): a row no wider than k times the padded
row keeps each token's attention within k times the padded forward's (benchmarks/packing.py compares bounds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PackedRows:
    """A micro-batch's real tokens packed into B rows of L positions, and where the hidden states that predict its
    completion tokens lie. K: the real completion tokens of the micro-batch."""

    input_ids: torch.Tensor  # [B, L] token ids (filler at the end of a row: the pad id 0)
    position_ids: torch.Tensor  # [B, L] the padded forward's position of each token (filler: 0)
    allowed: torch.Tensor  # [B, L, L] bool: query i attends to key j (a filler token only to itself)
    hidden_index: torch.Tensor  # [K] flat index (b·L + i) of the hidden state predicting each real completion token
    rows: torch.Tensor  # [K] the micro-batch row of each real completion token
    columns: torch.Tensor  # [K] its completion column

    @property
    def num_tokens(self) -> int:
        """Packed positions (B·L), filler included: what the decoder runs."""
        return self.input_ids.numel()

    def attention_mask(self, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
        """The [B, 1, L, L] mask as transformers' own mask functions give it to this attention implementation:
        boolean (True: attend) for SDPA, additive (0 or the dtype's minimum) for eager."""
        allowed = self.allowed[:, None]
        if attn_implementation == "sdpa":
            return allowed
        if attn_implementation == "eager":
            return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
                ~allowed, torch.finfo(dtype).min
            )
        raise ValueError(f"packed rows have no mask for attn_implementation={attn_implementation!r}")


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    completion_length: int,
    row_tokens: int | None = None,
) -> PackedRows | None:
    """Pack rows input_ids [N, P + T] (prompt left-padded, completion of width T; attention_mask [N, P + T],
    position_ids [N, P + T] as the padded forward takes them) into `PackedRows`; None when no completion token is
    real (nothing to predict).

    row_tokens: the most positions in one packed row (default and minimum: P + T - 1, what the longest completion
    needs with its prompt). Raises ValueError for a row whose prompt has no real token (nothing would predict its
    first completion token)."""
    width = input_ids.shape[1]
    prompt_length = width - completion_length
    if prompt_length < 1 or completion_length < 1:
        raise ValueError(f"pack_rows needs a prompt and a completion (got P={prompt_length}, T={completion_length}).")
    row_tokens = max(width - 1, row_tokens or 0)
    mask = attention_mask.bool()
    prompt_real = mask[:, :prompt_length]
    if not bool(prompt_real.any(-1).all()):
        raise ValueError(
            "pack_rows: a prompt has no real token (attention_mask all 0 over the first P columns); "
            "nothing predicts its first completion token."
        )
    completion_real = mask[:, prompt_length:]
    columns = torch.arange(1, completion_length + 1, device=input_ids.device)
    lengths = torch.where(completion_real, columns, 0).amax(-1).tolist()  # [N] up to the last real token
    if not any(lengths):
        return None
    # Rows share a prompt when its tokens and mask are equal (a GRPO batch repeats each prompt G times).
    prompts = torch.cat([input_ids[:, :prompt_length], attention_mask[:, :prompt_length].long()], 1)
    _, prompt_of = torch.unique(prompts, dim=0, return_inverse=True)
    first_real = prompt_real.long().argmax(-1).tolist()  # [N] first real prompt column
    prompt_of = prompt_of.tolist()
    packed_rows = first_fit(prompt_segments(prompt_of, first_real, lengths, prompt_length, row_tokens), row_tokens)
    row_width = max(packed[1] for packed in packed_rows)
    layout = lay_out(packed_rows, row_width, lengths, mask.tolist(), prompt_length)
    device = input_ids.device
    source_row = torch.tensor(layout.source_row, device=device)
    source_column = torch.tensor(layout.source_column, device=device)
    filler = torch.tensor(layout.filler, device=device)
    shape = (len(packed_rows), row_width)
    ids = input_ids[source_row, source_column].masked_fill(filler, 0).view(shape)
    positions = position_ids[source_row, source_column].masked_fill(filler, 0).view(shape)
    segment_of = torch.tensor(layout.segment_of, device=device).view(shape)
    completion_of = torch.tensor(layout.completion_of, device=device).view(shape)
    is_key = torch.tensor(layout.is_key, device=device).view(shape)
    # query i attends to key j: same segment, j <= i, j a real token, and j a prompt token or i's own completion's.
    causal = torch.ones(row_width, row_width, dtype=torch.bool, device=device).tril()
    allowed = (segment_of[:, :, None] == segment_of[:, None, :]) & causal & is_key[:, None, :]
    allowed &= (completion_of[:, None, :] == -1) | (completion_of[:, :, None] == completion_of[:, None, :])
    allowed |= filler.view(shape)[:, :, None] & torch.eye(row_width, dtype=torch.bool, device=device)
    return PackedRows(
        ids,
        positions,
        allowed,
        torch.tensor(layout.hidden_index, device=device),
        torch.tensor(layout.target_rows, device=device),
        torch.tensor(layout.target_columns, device=device),
    )


def prompt_segments(
    prompt_of: list[int], first_real: list[int], lengths: list[int], prompt_length: int, row_tokens: int
) -> list[list]:
    """Segments: [source row of the prompt, prompt's first real column, [completion rows], tokens] with at most
    `row_tokens` tokens, the rows of one prompt in as few segments as fit, in row order."""
    segments, open_segment = [], {}
    for row in range(len(lengths)):
        if lengths[row] == 0:
            continue  # no real completion token: nothing to predict
        prompt, need = prompt_of[row], lengths[row] - 1  # the last real token predicts nothing
        segment = open_segment.get(prompt)
        if segment is None or segment[3] + need > row_tokens:
            segment = [row, first_real[row], [], prompt_length - first_real[row]]
            segments.append(segment)
            open_segment[prompt] = segment
        segment[2].append(row)
        segment[3] += need
    return segments


def first_fit(segments: list[list], row_tokens: int) -> list[list]:
    """Rows [[segments], tokens used] of at most `row_tokens` tokens: first-fit of the segments, longest first."""
    segments.sort(key=lambda s: -s[3])
    packed_rows: list[list] = []
    for segment in segments:
        for packed in packed_rows:
            if packed[1] + segment[3] <= row_tokens:
                packed[0].append(segment)
                packed[1] += segment[3]
                break
        else:
            packed_rows.append([[segment], segment[3]])
    return packed_rows


@dataclass
class PackedLayout:
    """Where a micro-batch's tokens go in the packed rows, position by position (B·L of each list but the last
    three), and which position predicts each real completion token (K of those)."""

    source_row: list[int] = field(default_factory=list)  # the position's row in input_ids
    source_column: list[int] = field(default_factory=list)  # its column there
    segment_of: list[int] = field(default_factory=list)  # its segment (filler: -1 - its packed row)
    completion_of: list[int] = field(default_factory=list)  # its completion row (-1: a prompt token or filler)
    is_key: list[bool] = field(default_factory=list)  # other tokens may attend to it (a real token)
    filler: list[bool] = field(default_factory=list)  # filler up to the common row width
    hidden_index: list[int] = field(default_factory=list)  # per real completion token: its predicting position
    target_rows: list[int] = field(default_factory=list)  # its micro-batch row
    target_columns: list[int] = field(default_factory=list)  # its completion column

    def add(self, row: int, column: int, segment: int, completion: int, key: bool, is_filler: bool = False) -> None:
        self.source_row.append(row), self.source_column.append(column), self.segment_of.append(segment)
        self.completion_of.append(completion), self.is_key.append(key), self.filler.append(is_filler)


def lay_out(
    packed_rows: list[list], row_width: int, lengths: list[int], real: list[list[bool]], prompt_length: int
) -> PackedLayout:
    """The packed rows' positions, each row's segments one after another, then filler up to `row_width`."""
    layout = PackedLayout()
    segment_id = 0
    for b, (row_segments, used) in enumerate(packed_rows):
        base, position = b * row_width, 0
        for prompt_row, start, completion_rows, _ in row_segments:
            for column in range(start, prompt_length):
                layout.add(prompt_row, column, segment_id, -1, real[prompt_row][column])
            position += prompt_length - start
            prompt_end = base + position - 1  # predicts each completion's first token
            for row in completion_rows:
                for t in range(lengths[row]):
                    if real[row][prompt_length + t]:  # predicted by the prompt's end or the previous token
                        layout.hidden_index.append(prompt_end if t == 0 else base + position + t - 1)
                        layout.target_rows.append(row), layout.target_columns.append(t)
                for t in range(lengths[row] - 1):
                    layout.add(row, prompt_length + t, segment_id, row, real[row][prompt_length + t])
                position += lengths[row] - 1
            segment_id += 1
        for _ in range(row_width - used):  # filler up to the common row width: attends to itself only
            layout.add(0, 0, -1 - b, -1, False, True)
    return layout
