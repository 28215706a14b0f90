"""Constrained outputs stay valid UTF-8: which tokens may follow the output's bytes so far.

xgrammar (0.2.9) matches its grammars' characters on a lenient UTF-8 decoding that takes a UTF-16 surrogate's
bytes (`ED A0`-`ED BF` and a continuation byte) for a character, so a JSON string or a regex's `.` could hold
bytes no UTF-8 text has (decoded, each such byte is a U+FFFD, and a `maxLength` fails). A constrained row's
bitmask is therefore ANDed with the tokens its output can take next and stay valid UTF-8, whatever xgrammar
admits (overlong forms, bytes past U+10FFFF, F5-FF and stray continuation bytes included).

Validity is a small automaton over the output's bytes: `NUM_STATES` states between bytes (at a character's
start, or owing continuation bytes, some of them range-checked). A token takes each state to another or to
REJECT; `Utf8Tables` precomputes that once per tokenizer, as rows of bytes (a token's next state: one index
per accepted token) and as packed bitmasks (the tokens allowed from each state: one gather and AND a step).
CPU code on numpy and torch; a CUDA sampler receives the ANDed host bitmask as before."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

#: states between bytes: 0 at a character's start; 1, 2, 3 continuation bytes (80-BF) still owed; after E0
#: (4: next A0-BF, not overlong), ED (5: next 80-9F, not a surrogate), F0 (6: next 90-BF, not overlong),
#: F4 (7: next 80-8F, not past U+10FFFF)
NUM_STATES = 8
#: a token's bytes from a state that make the output invalid UTF-8
REJECT = 255


def _byte_table() -> np.ndarray:
    """[NUM_STATES + 1, 256] uint8: the state after one byte (row NUM_STATES: rejected, stays so)."""
    t = np.full((NUM_STATES + 1, 256), NUM_STATES, dtype=np.uint8)
    t[0, 0x00:0x80] = 0
    t[0, 0xC2:0xE0] = 1
    t[0, 0xE0] = 4
    t[0, 0xE1:0xED] = 2
    t[0, 0xED] = 5
    t[0, 0xEE:0xF0] = 2
    t[0, 0xF0] = 6
    t[0, 0xF1:0xF4] = 3
    t[0, 0xF4] = 7
    t[1, 0x80:0xC0] = 0
    t[2, 0x80:0xC0] = 1
    t[3, 0x80:0xC0] = 2
    t[4, 0xA0:0xC0] = 1
    t[5, 0x80:0xA0] = 1
    t[6, 0x90:0xC0] = 2
    t[7, 0x80:0x90] = 2
    return t


def token_transitions(decoded_vocab: Sequence[bytes], width: int, stop_token_ids: Sequence[int]) -> np.ndarray:
    """[NUM_STATES, width] uint8: the state after token t's bytes from state s, or REJECT. Ids past
    `decoded_vocab` (a padded vocabulary) are rejected; a stop token (no bytes) only at a character's start (a
    response must not end inside a character)."""
    out = np.full((NUM_STATES, width), REJECT, dtype=np.uint8)
    n = min(len(decoded_vocab), width)
    ascii_ids = [i for i in range(n) if decoded_vocab[i].isascii()]
    out[0, ascii_ids] = 0                       # most tokens: valid only at a character's start, which they keep
    other = np.array([i for i in range(n) if not decoded_vocab[i].isascii()], dtype=np.int64)
    if len(other):
        table = _byte_table()
        tokens = [decoded_vocab[i] for i in other]
        lengths = np.array([len(b) for b in tokens], dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        flat = np.frombuffer(b"".join(tokens), dtype=np.uint8)
        order = np.argsort(-lengths, kind="stable")      # the tokens still running at byte j: order[:count[j]]
        count = np.searchsorted(-lengths[order], -np.arange(int(lengths.max())), side="left")
        state = np.repeat(np.arange(NUM_STATES, dtype=np.uint8)[:, None], len(other), axis=1)   # [S, len(other)]
        for j, c in enumerate(count):
            live = order[:c]
            state[:, live] = table[state[:, live], flat[starts[live] + j]]
        state[state == NUM_STATES] = REJECT
        out[:, other] = state
    stops = [t for t in stop_token_ids if t < width]
    out[:, stops] = REJECT
    out[0, stops] = 0
    return out


def pack_rows(allowed: np.ndarray) -> torch.Tensor:
    """[R, vocab] bool -> [R, ceil(vocab / 32)] int32 words (bit j of word w: token 32w + j, as xgrammar)."""
    num_words = -(-allowed.shape[1] // 32)
    bits = np.zeros((allowed.shape[0], num_words * 32), dtype=bool)
    bits[:, :allowed.shape[1]] = allowed
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view("<i4").astype(np.int32))


class Utf8Tables:
    """One tokenizer's UTF-8 tables (built once, with the grammar compiler; empty until then).

    `next_rows[s][t]`: the state after token t from state s (REJECT: the output would not be UTF-8), what a
    sequence's `GrammarState` follows as it accepts tokens. `masks`: [2 * NUM_STATES, ceil(width / 32)] int32,
    row s the tokens allowed from state s, row NUM_STATES + s the same without the tokens holding a control
    byte (< 0x20; stop tokens kept), for JSON grammars: a constrained row's bitmask is ANDed with its row."""

    __slots__ = ("masks", "next_rows", "control_byte_ids")

    def __init__(self) -> None:
        self.next_rows: list[bytes] | None = None
        self.masks: torch.Tensor | None = None
        self.control_byte_ids: frozenset[int] = frozenset()

    def build(self, decoded_vocab: Sequence[bytes], width: int, stop_token_ids: Sequence[int]) -> None:
        nxt = token_transitions(decoded_vocab, width, stop_token_ids)
        allowed = nxt != REJECT                                                   # [S, width]
        no_control = np.zeros(width, dtype=bool)
        n = min(len(decoded_vocab), width)
        no_control[[i for i in range(n) if not any(c < 0x20 for c in decoded_vocab[i])]] = True
        no_control[[t for t in stop_token_ids if t < width]] = True
        self.control_byte_ids = frozenset(np.flatnonzero(~no_control).tolist())
        self.masks = pack_rows(np.concatenate([allowed, allowed & no_control]))
        self.next_rows = [row.tobytes() for row in nxt]                           # last: set means built


def advance(next_rows: Sequence[bytes], state: int, token_ids: Sequence[int]) -> int:
    """The state after `token_ids` (REJECT as soon as one makes the bytes invalid)."""
    for t in token_ids:
        state = next_rows[state][t]
        if state == REJECT:
            break
    return state
