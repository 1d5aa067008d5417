"""Beam search over the Sampler's KV cache: ``Sampler.generate`` with ``SamplingParams(num_beams=N)``.

    sampler.generate(prompts, keys, SamplingParams(temperature=0, num_beams=4, max_new_tokens=64))

**What it computes.** The search of ``transformers``' ``generate(num_beams=N, do_sample=False)``
(greedy beams, ``num_return_sequences`` = 1 by default), step by step:

- Each of a prompt's N beams adds the log-softmax (fp32, untempered) of its next-token logits to
  its running score; the best ``K = max(2, 1 + len(stop_token_ids)) * N`` (beam, token)
  continuations of all N beams are kept, in descending score (``torch.topk``). At the first step
  only beam 0 counts (the others start at -1e9): the N beams are N copies of the prompt.
- A continuation that ends in a stop token, or that reaches the budget (``max_new_tokens``, or the
  context's end), is finished; the best N continuations that are not become the next running
  beams. A finished one is a hypothesis only if it is among the best N of the K; its score is its
  summed log-prob divided by ``len ** length_penalty``, ``len`` the tokens it generated (the stop
  token included). The N best hypotheses are kept.
- ``early_stopping``: False (the default) stops a prompt once it holds N hypotheses and its best
  running beam, divided by its current length ``** length_penalty``, cannot beat the worst of them;
  "never" measures that bound at the budget's length where ``length_penalty > 0``; True stops as
  soon as N hypotheses are held. A prompt also stops when every continuation is finished (the
  budget). The constants and the order of the float32 operations are transformers' own.

**Keyed like sampling.** A search has no randomness: its result depends on the prompt and the
sampler's settings only. Keys still name the samples: the sample of ``SampleKey(..., sample_index=j)``
is the search's ``j``-th best hypothesis (transformers' ``num_return_sequences``), so sample 0 is
the best beam, and samples of one prompt and key (up to ``sample_index``) share one search.
``Sample.logprobs`` are the untempered log-probs of the hypothesis' tokens, as sampling gives.

**Layout and batch invariance.** A search takes N consecutive cache rows (a slot; ``max_batch // N``
slots, the rows beyond them idle). Every forward is the Sampler's own, at its static shapes: the
prompt is prefilled into the slot's first row (``Sampler._prefill``) and copied into the others; every
step runs the decode forward over all ``max_batch`` rows, each beam's last token at its position;
after a step each beam's cache row is copied from its parent's (``reorder_rows``). The selection
runs per slot (row-wise ``topk`` over that slot's N x vocab scores), so a prompt's beams do not depend
on which prompts share the batch, their order or which slot they take. A finished search's slot
takes the next pending one at the next step (one host sync a step: the slots' stop flags and parents).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from core.exceptions import ConfigError
from models.generation.kv_cache import KVCache
from models.generation.scheduler import RowSlots

if TYPE_CHECKING:
    from models.generation.sampler import Sample, SampleKey, Sampler, SamplingParams

# transformers' stand-in for "excluded": added to a score, it ranks the entry below every real one.
_EXCLUDED = -1.0e9


@dataclass(frozen=True)
class Search:
    """One beam search: a prompt, and the most hypotheses any of its keys asks for."""

    prompt: list[int]
    """The prompt's token ids."""
    budget: int
    """Tokens it may generate (max_new_tokens, at most what max_len leaves)."""
    returned: int
    """Hypotheses handed back: 1 + the highest sample_index asked of it."""


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its tokens, their log-probs and its length-penalized score."""

    tokens: list[int]
    """Generated ids (the stop token included)."""
    logprobs: list[float]
    """The untempered log-prob of each."""
    score: float
    """Summed log-probs / len(tokens) ** length_penalty."""


def check_beams(params: "SamplingParams", *, max_batch: int, vocab_size: int) -> None:
    """A ConfigError naming ``sampling.num_beams`` where this sampler cannot search ``params``' beams."""
    beams = params.num_beams
    if beams > max_batch:
        raise ConfigError(f"sampling num_beams={beams} needs {beams} cache rows, but the sampler has "
                          f"max_batch={max_batch}", key="sampling.num_beams",
                          hint="raise the sampler's max_batch (--batch) to at least num_beams")
    kept = _candidates(params)
    if kept > vocab_size:
        raise ConfigError(f"sampling num_beams={beams} keeps {kept} continuations a step, more than the "
                          f"vocabulary's {vocab_size} tokens", key="sampling.num_beams",
                          hint="use fewer beams or fewer stop tokens")


def beam_search(sampler: "Sampler", prompts: list[list[int]], keys: Sequence["SampleKey"],
                params: "SamplingParams") -> list["Sample"]:
    """One sample per (prompt, key): the ``key.sample_index``-th best hypothesis of the prompt's search."""
    from models.generation.sampler import Sample

    check_beams(params, max_batch=sampler.max_batch, vocab_size=sampler.spec.vocab_size)
    searches: dict[tuple, int] = {}  # (prompt, key but its sample_index) -> index into `wanted`
    wanted: list[tuple[list[int], int]] = []  # (prompt, hypotheses asked)
    of_sample = []
    for prompt, key in zip(prompts, keys):
        if not 0 <= key.sample_index < params.num_beams:
            raise ConfigError(f"sample_index {key.sample_index} asks for hypothesis {key.sample_index + 1} of a "
                              f"beam search keeping num_beams={params.num_beams}", key="sampling.num_beams",
                              hint="ask at most num_beams samples of a prompt (--samples <= --num-beams)")
        identity = (tuple(prompt), key.seed, key.purpose, key.step, key.prompt_index)
        index = searches.setdefault(identity, len(wanted))
        if index == len(wanted):
            wanted.append((prompt, 0))
        wanted[index] = (prompt, max(wanted[index][1], key.sample_index + 1))
        of_sample.append(index)
    budgets = [min(params.max_new_tokens, sampler.max_len - len(prompt)) for prompt, _ in wanted]
    found = BeamRows(sampler, params).run([Search(p, b, r) for (p, r), b in zip(wanted, budgets)])
    stops = set(params.stop_token_ids)
    samples = []
    for index, key in zip(of_sample, keys):
        best = found[index][key.sample_index]
        ended = bool(best.tokens) and best.tokens[-1] in stops
        samples.append(Sample(tokens=best.tokens, logprobs=best.logprobs, finish_reason="stop" if ended else "length"))
    return samples


def reorder_rows(cache: KVCache, rows: torch.Tensor, parents: torch.Tensor) -> None:
    """Cache rows ``rows`` ((k,) int64, distinct) := rows ``parents`` ((k,) int64) as they were before:
    each buffer's parent rows are gathered (a copy) before any row is written, so a row may be
    both a parent and a target."""
    if rows.numel() == 0:
        return
    for buffer in (*cache.tensors(), cache.position_offsets):  # a row's position offset goes with its keys
        buffer.index_copy_(0, rows, buffer.index_select(0, parents))


def _candidates(params: "SamplingParams") -> int:
    """K: continuations kept a step, enough that N of them are not finished by a stop token."""
    return max(2, 1 + len(params.stop_token_ids)) * params.num_beams


class BeamRows:
    """The searches' state in the sampler's cache rows: ``max_batch // N`` slots of N beams each.

    Device tensors, one entry per slot (S slots, N beams, K candidates, W = the longest budget):
    the running beams' scores, last tokens, tokens and log-probs so far; the N hypotheses kept
    (scores, tokens, log-probs, lengths, whether each is a finished one) and whether a better one
    is still possible. Host: which search each slot holds, its step and budget.
    """

    def __init__(self, sampler: "Sampler", params: "SamplingParams") -> None:
        self.sampler, self.params = sampler, params
        self.beams = params.num_beams
        self.slots = sampler.max_batch // self.beams
        self.kept = _candidates(params)
        self.device = sampler.device
        table = torch.zeros(sampler.spec.vocab_size, dtype=torch.bool)
        table[[t for t in params.stop_token_ids if 0 <= t < len(table)]] = True
        self.stops = table.to(self.device)
        # Only the best N of the K continuations may become hypotheses.
        self.top_beams = (torch.arange(self.kept, device=self.device) < self.beams)[None, :]

    def run(self, searches: list[Search]) -> list[list[Hypothesis]]:
        """Each search's hypotheses, best first (``search.returned`` of them)."""
        if not searches:
            return []
        slots, beams, device = self.slots, self.beams, self.device
        width = max(s.budget for s in searches)
        self._allocate(width)
        occupancy = RowSlots(slots, len(searches))
        steps = np.zeros(slots, dtype=np.int64)
        done = np.zeros(slots, dtype=bool)
        found: list[Optional[list[Hypothesis]]] = [None] * len(searches)
        while True:
            handed_back, assigned = occupancy.refill(done)
            for slot, search in handed_back:
                found[search] = self._hypotheses(slot, searches[search].returned)
            if assigned:
                self._start(assigned, searches)
                steps[[slot for slot, _ in assigned]] = 0
            if not occupancy.busy:
                break
            held = occupancy.occupant
            busy = np.array([s is not None for s in held])
            lengths = np.array([len(searches[s].prompt) if s is not None else 1 for s in held])
            budgets = np.array([searches[s].budget if s is not None else 1 for s in held])
            steps[~busy] = 0  # an idle slot's rows decode token 0 at position 0, and nothing reads them
            logits = self._forward(np.repeat(lengths - 1 + steps, beams))
            flags, parents = self._step(logits, steps, budgets)
            steps += 1
            done = flags & busy
            moved = [(slot * beams + i, slot * beams + int(parent))
                     for slot in np.flatnonzero(busy & ~done) for i, parent in enumerate(parents[slot])
                     if parent != i]
            if moved:
                rows, sources = (torch.tensor(side, dtype=torch.int64, device=device) for side in zip(*moved))
                reorder_rows(self.sampler.cache, rows, sources)
        return [f for f in found if f is not None]

    # ------------------------------------------------------------------ state

    def _allocate(self, width: int) -> None:
        s, n, device = self.slots, self.beams, self.device
        self.running_scores = torch.zeros(s, n, device=device)
        self.last = torch.zeros(s, n, dtype=torch.long, device=device)
        self.running_tokens = torch.zeros(s, n, width, dtype=torch.long, device=device)
        self.running_logprobs = torch.zeros(s, n, width, device=device)
        self.scores = torch.zeros(s, n, device=device)
        self.tokens = torch.zeros(s, n, width, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(s, n, width, device=device)
        self.lengths = torch.zeros(s, n, dtype=torch.long, device=device)
        self.finished = torch.zeros(s, n, dtype=torch.bool, device=device)
        self.improvable = torch.ones(s, 1, dtype=torch.bool, device=device)

    def _start(self, assigned: list[tuple[int, int]], searches: list[Search]) -> None:
        """Prefill the assigned (slot, search) pairs' prompts into their slots' first rows, copy them
        into the slots' other rows, and reset the slots' state (beam 0 at 0, the others excluded)."""
        sampler, beams = self.sampler, self.beams
        slots = [slot for slot, _ in assigned]
        prompts = [searches[search].prompt for _, search in assigned]
        sampler._prefill([slot * beams for slot in slots], prompts)
        copies = [(slot * beams + i, slot * beams) for slot in slots for i in range(1, beams)]
        if copies:
            rows, sources = (torch.tensor(side, dtype=torch.int64, device=self.device) for side in zip(*copies))
            reorder_rows(sampler.cache, rows, sources)
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        start = torch.full((len(slots), beams), _EXCLUDED, device=self.device)
        start[:, 0] = 0.0
        self.running_scores[index] = start
        self.last[index] = torch.tensor([p[-1] for p in prompts], device=self.device)[:, None].expand(-1, beams)
        self.scores[index] = _EXCLUDED
        self.finished[index] = False
        self.lengths[index] = 0
        self.improvable[index] = True

    def _forward(self, positions: np.ndarray) -> torch.Tensor:
        """(max_batch, vocab) logits of every row's last token at its position (idle rows: token 0 at 0)."""
        batch = self.sampler.max_batch
        used = self.slots * self.beams
        tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        tokens[:used, 0] = self.last.reshape(-1)
        where = np.zeros(batch, dtype=np.int64)
        where[:used] = positions
        position_ids = torch.from_numpy(where).to(self.device)[:, None]
        return self.sampler._decode_logits()(tokens, position_ids)

    def _step(self, logits: torch.Tensor, steps: np.ndarray, budgets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One step of every slot's search (transformers' order of operations) -> (done (S,), parents (S, N)).

        ``steps``: tokens each slot has generated before this step; ``budgets``: its budget.
        """
        s, n, k = self.slots, self.beams, self.kept
        penalty, early = self.params.length_penalty, self.params.early_stopping
        logprobs = F.log_softmax(logits[: s * n].to(torch.float32), dim=-1)  # (S*N, V)
        vocab = logprobs.shape[-1]
        scores = (logprobs.view(s, n, vocab) + self.running_scores[:, :, None]).view(s, n * vocab)
        top_scores, top = torch.topk(scores, k=k)  # (S, K), best first
        parent, token = top // vocab, top % vocab
        column = torch.from_numpy(steps).to(self.device)[:, None, None].expand(s, k, 1)  # (S, K, 1)
        top_tokens = _gather(self.running_tokens, parent).scatter(2, column, token[:, :, None])
        token_logprobs = logprobs.view(s, n * vocab).gather(1, top)
        top_logprobs = _gather(self.running_logprobs, parent).scatter(2, column, token_logprobs[:, :, None])
        at_budget = torch.from_numpy(steps + 1 >= budgets).to(self.device)[:, None]
        hits = self.stops[token] | at_budget  # (S, K): the continuation is finished

        # The best N unfinished continuations run on.
        running = top_scores + hits.to(torch.float32) * _EXCLUDED
        keep = torch.topk(running, k=n)[1]  # (S, N)
        self.running_tokens, self.running_logprobs = _gather(top_tokens, keep), _gather(top_logprobs, keep)
        self.running_scores = running.gather(1, keep)
        self.last = token.gather(1, keep)
        parents = parent.gather(1, keep)

        # Finished continuations among the best N become hypotheses if they beat the kept ones.
        just = hits & self.top_beams
        lengths = torch.from_numpy(steps + 1).to(self.device)
        candidates = top_scores / _power(steps + 1, penalty, self.device)
        full = self.finished.all(dim=-1, keepdim=True) & (early is True)
        candidates = candidates + full.to(torch.float32) * _EXCLUDED
        candidates = candidates + (~self.improvable).to(torch.float32) * _EXCLUDED
        candidates = candidates + (~just) * _EXCLUDED
        merged = torch.cat((self.scores, candidates), dim=1)
        pick = torch.topk(merged, k=n)[1]
        self.scores = merged.gather(1, pick)
        self.tokens = _gather(torch.cat((self.tokens, top_tokens), dim=1), pick)
        self.logprobs = _gather(torch.cat((self.logprobs, top_logprobs), dim=1), pick)
        self.lengths = torch.cat((self.lengths, lengths[:, None].expand(s, k)), dim=1).gather(1, pick)
        self.finished = torch.cat((self.finished, just), dim=1).gather(1, pick)

        # Can a running beam still beat the worst hypothesis?
        generated = steps + 1
        best_length = budgets if (early == "never" and penalty > 0.0) else generated
        best_possible = self.running_scores[:, :1] / _power(best_length, penalty, self.device)
        worst = torch.where(self.finished, torch.min(self.scores, dim=1, keepdim=True)[0], _EXCLUDED)
        self.improvable = self.improvable & torch.any(best_possible > worst, dim=-1, keepdim=True)
        open_beam = ~(self.finished.all(dim=-1) & (early is True))
        going = self.improvable.any(dim=-1) & open_beam & ~hits.all(dim=-1)
        host = torch.cat((going[:, None].long(), parents), dim=1).cpu().numpy()
        return ~host[:, 0].astype(bool), host[:, 1:]

    def _hypotheses(self, slot: int, count: int) -> list[Hypothesis]:
        """The slot's best ``count`` hypotheses, best first."""
        lengths = self.lengths[slot, :count].tolist()
        tokens = self.tokens[slot, :count].tolist()
        logprobs = self.logprobs[slot, :count].tolist()
        scores = self.scores[slot, :count].tolist()
        return [Hypothesis(t[:m], p[:m], score) for t, p, m, score in zip(tokens, logprobs, lengths, scores)]


def _gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(S, M, W) rows picked by ``index`` (S, J) along the beams -> (S, J, W)."""
    return tensor.gather(1, index[:, :, None].expand(-1, -1, tensor.shape[2]))


def _power(lengths: np.ndarray, penalty: float, device: torch.device) -> torch.Tensor:
    """(S, 1) float32: each slot's ``length ** penalty``, computed in Python floats as transformers does."""
    return torch.tensor([[float(int(m) ** penalty)] for m in lengths], dtype=torch.float32, device=device)

