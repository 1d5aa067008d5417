"""Preference records -> one pair of documents: prompt + chosen, then prompt + rejected.

A record ``{"prompt": ..., "chosen": ..., "rejected": ...}`` holds strings or message lists.
A string prompt is one user message; a string response is one assistant message; a list is
taken as messages (``data/chat_template.py`` checks them). Each side is rendered with the
chat template, as SFT renders a conversation, and only the response carries loss (its
content and end-of-turn marker: ``data.loss_on=completion`` on that conversation).

The encoded pair is one pipeline document of two pieces: the chosen ids followed by the rejected
ids (``Encoded.pieces``: where the rejected ones start), with the document fields ``target_mask``,
``pair_role`` (1 chosen, 2 rejected, per token) and, where read, ``pair_margin`` (per document).
The whole-document packer lays the two out as two adjacent documents of one row
(data/pipeline/packing.py ``WholeDocPacker``), so a pair never straddles micro-batches or ranks,
whatever the world size; the batch adds ``pair_index``, the pair's number within its row.

Margins: a record may hold ``margin``, a finite number, the score gap its pair's Bradley-Terry loss
asks for (training/objectives/reward_model.py). The pipeline reads it only where the objective asks
(``record_fields``: the reward model under ``margin_from: record``): then every record must hold one,
``encode`` returns it as a fourth value, and the pair carries it (extra ``pair_margin``). Otherwise
it is ignored, and a record with or without it encodes to the same three values.

Bad records (``RecordError``: an error naming file and record, or skipped and counted under
``data.on_bad_record=skip``): a missing field, an empty response, a pair whose chosen and
rejected responses render to the same tokens (a pair that cannot prefer anything), and, where
margins are read, a missing or non-finite ``margin``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from data.chat_template import ChatTemplate, RecordError, _check_messages, check_template, token_mask
from data.fields import TARGET_MASK, DocField, Pack
from data.record_kinds import Encoded, EncoderSetup, RecordKind

FIELDS = ("prompt", "chosen", "rejected")
MARGIN = "margin"
"""The optional record field of a pair's margin (module docstring)."""
CHOSEN, REJECTED = 1, 2
"""The ``pair_role`` of a chosen and of a rejected response's tokens (0: no pair)."""


def _pair_index(role: np.ndarray, position_ids: np.ndarray) -> dict[str, np.ndarray]:
    """(B, T) the pair's number within its row (-1 outside pairs): each chosen span opens a pair."""
    starts_pair = (role == CHOSEN) & (position_ids == 0)
    pair_index = np.cumsum(starts_pair, axis=1) - 1
    pair_index[role == 0] = -1
    return {"pair_index": pair_index.astype(np.int64)}


PAIR_ROLE = DocField("pair_role", Pack.TOKENS, dtype="int8", finish=_pair_index)
"""Per token: 1 chosen, 2 rejected, 0 neither; the batch adds ``pair_index`` from it."""
PAIR_MARGIN = DocField("pair_margin", Pack.DOCUMENT, dtype="float32")
"""Per pair, where margins are read: the record's ``margin`` on the pair's tokens, 0 elsewhere."""


def pair_margin(record: dict) -> float:
    """A preference record's ``margin``: a finite number; RecordError if absent or not one."""
    if MARGIN not in record:
        raise RecordError(f"preference record has no {MARGIN!r}, and each pair's margin is read from its record "
                          f"(objective.reward_model.margin_from: record) (keys: {', '.join(list(record)[:8])})")
    value = record[MARGIN]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RecordError(f"{MARGIN!r} must be a finite number, got {value!r}")
    return float(value)


def pair_messages(record: Any) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) message lists of a preference record; RecordError if malformed."""
    if not isinstance(record, dict):
        raise RecordError(f"record is a {type(record).__name__}, not a JSON object")
    missing = [key for key in FIELDS if key not in record]
    if missing:
        raise RecordError(f"preference record has no {', '.join(map(repr, missing))} "
                          f"(keys: {', '.join(list(record)[:8])})")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RecordError("'prompt' is empty")
        prompt = [{"role": "user", "content": prompt}]
    else:
        prompt = _check_messages(prompt, "prompt")
    responses = []
    for key in ("chosen", "rejected"):
        value = record[key]
        if isinstance(value, str):
            if not value.strip():
                raise RecordError(f"{key!r} is empty: nothing to compare")
            value = [{"role": "assistant", "content": value}]
        else:
            value = _check_messages(value, key)
        responses.append(value)
    return prompt, responses[0], responses[1]


class PreferenceEncoder:
    """Record -> (int32 ids of chosen then rejected, bool target mask, where rejected starts), and
    with ``margins`` the record's margin as a fourth value."""

    def __init__(self, template: ChatTemplate, tokenizer, *, margins: bool = False) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self.margins = margins

    def encode(self, record: Any) -> tuple:
        prompt, chosen, rejected = pair_messages(record)
        margin = pair_margin(record) if self.margins else None
        sides = [self._side(prompt, response) for response in (chosen, rejected)]
        (c_ids, c_mask), (r_ids, r_mask) = sides
        if np.array_equal(c_ids, r_ids) and np.array_equal(c_mask, r_mask):
            raise RecordError("'chosen' and 'rejected' are identical: the pair prefers nothing")
        ids = np.concatenate([c_ids, r_ids]).astype(np.int32)
        if margin is not None:
            return ids, np.concatenate([c_mask, r_mask]), len(c_ids), margin
        return ids, np.concatenate([c_mask, r_mask]), len(c_ids)

    def document(self, record: Any) -> Encoded:
        """The pair as one document of two pieces (module docstring)."""
        ids, mask, cut, *margin = self.encode(record)
        roles = np.full(len(ids), REJECTED, dtype=np.int8)
        roles[:cut] = CHOSEN
        fields = {TARGET_MASK.name: mask, PAIR_ROLE.name: roles}
        if margin:
            fields[PAIR_MARGIN.name] = margin[0]
        return Encoded(ids, fields, pieces=(cut,))

    def check(self) -> None:
        """Refuse a template that renders no assistant span (as chat sources do)."""
        check_template(self.template, self.tokenizer)

    def _side(self, prompt: list[dict], response: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        rendered = self.template.render_spans(prompt + response, len(prompt), "completion")
        ids, offsets = self.tokenizer.encode_offsets(rendered.text)
        mask = token_mask(offsets, rendered.spans)
        if not mask.any():
            raise RecordError("a response of the pair holds no token to train")
        return np.asarray(ids, dtype=np.int32), mask


def _pairs(setup: EncoderSetup) -> PreferenceEncoder:
    return PreferenceEncoder(setup.template, setup.tokenizer, margins=MARGIN in setup.record_fields)


KIND = RecordKind(name="preference", summary='{"prompt", "chosen", "rejected"}: a pair of documents (DPO, reward models)',
                  columns=FIELDS, encoder=_pairs, uses_template=True, fields=(TARGET_MASK, PAIR_ROLE, PAIR_MARGIN),
                  record_fields=(MARGIN,))
