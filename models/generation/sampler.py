"""Batched autoregressive generation over a preallocated KV cache, for any ``GenerationModel``.

    sampler = Sampler(model, max_batch=64, max_len=512)
    samples = sampler.generate(prompts, keys, SamplingParams(temperature=0.7, top_p=0.9))

**Reproducible by construction.** A sample's randomness is one uniform number per generated
position, derived on the host from its ``SampleKey`` (seed, purpose, step, prompt index,
sample index) with a counter-based 64-bit hash, and nothing else: no generator state is
shared between rows or calls. A token is drawn by inverting the CDF of the (tempered,
filtered) next-token distribution at that uniform, in vocabulary order, summed exactly in
integers (probabilities in units of 2^-32; the filters' kept sets without a sort,
models/generation/nucleus.py). The model runs every forward at one
static shape, ``max_batch`` rows (a call with fewer prompts is padded with dummy rows) and
prompts fed ``prefill_rows`` at a time in chunks of ``prefill_chunk`` positions into a cache of
fixed size, so the
arithmetic a row goes through does not depend on which prompts share its batch, how many
there are, or in which order they come; only on the Sampler's own settings (max_batch,
max_len, prefill_chunk, prefill_rows, device, dtype, compile). That holds bitwise wherever a kernel's
result for one row depends on the tensor's shape but not on the other rows' values or the
row's index (measured on the CPU, tests/models/test_sampler.py; on the GPU,
benchmarks/generate.py --check-determinism measures it). A CPU GEMM's row results *do*
change with the number of rows (e.g. 1 vs 5 vs 8 rows on the CPU the tests run on),
which is why the shapes are static rather than "as many rows as prompts".

**Layout.** Cache slot p of row b holds the key/value of row b's token at position p. A
prompt of length n is prefilled at positions 0..n-2 (in fixed chunks; positions beyond a
short row's prompt compute padding that is never read), and decoding starts by feeding the
last prompt token at position n-1, so every generated token comes out of the same decode
step. Slots a row has not written are masked out.

**Scheduling.** A call with more samples than max_batch keeps every row busy: a row whose
sample has finished takes the next pending one at the next refill point, with a prefill
that leaves the other rows' caches alone (models/generation/scheduler.py). Each row decodes at its
own position with its own key's uniforms, so refill changes no sample. Multi-turn episodes
(``generate_episodes``) keep an episode in its row across turns: the ids appended after a turn
go through the decode step as forced steps (from ``extend_chunk`` ids on, by chunked forwards),
and only prompts are ever prefilled.

**Log-probs.** ``Sample.logprobs[i]`` is log softmax of the model's *untempered* logits
(fp32) at the chosen token: what a trainer computes for the same tokens (up to kernel
differences between the cached and the training forward), whatever the sampling
temperature or filters were.

**Speed (CUDA).** The decode step's model forward is compiled with static shapes and, by
default, replayed as a CUDA graph (``mode="reduce-overhead"``); the sampling rule (softmax,
top-p's cut and the draw: Triton kernels where Triton is installed, models/generation/nucleus.py;
the model's ``Numerics`` picks them)
is captured as a second graph. The prefill's forward (``prefill_rows`` x ``prefill_chunk``)
is compiled and replayed as a graph with its own memory pool. Under ``Numerics.batch_invariant``
nothing is compiled (the compiler would replace the batch-invariant kernels with its own): the
same forwards and the whole refill decode step are captured as they run eagerly
(``CapturedGraph``), the kernels the graph replays being the ones the eager step launched, so a
replayed step computes the eager step's bits; a model with mixtures of experts stays eager there
(its batch-invariant expert loop reads each expert's token count on the host). A refill point waits for the
device once, for done flags fetched a step before it (so the device runs that step
meanwhile); what it sends and fetches goes in page-locked copies that do not, and with
``prefill_ahead`` the next pending prompts wait prefilled in a staging pool, filled on a
second stream beside the decode steps. On other devices everything runs eagerly.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from core.exceptions import ConfigError, DataError
from models import ModelInputs, model_forward
from models.generation.kv_cache import KVCache
from models.generation.nucleus import UNIFORM_BITS, CapturedGraph, draw_kept, fixed_point, inverse_cdf, nucleus_cut
from models.generation.protocol import GenerationModel, check_plain
from models.generation.routing_record import cache_for, with_routing
from models.generation.scheduler import EpisodeRows, RowSlots, RowState, StagingPool, done_lag, upload
from models.numerics import stock_token_logprobs

FinishReason = Literal["stop", "length"]
Schedule = Literal["refill", "groups"]

# Prompts prefilled per forward (at most max_batch): a refill point's prefill costs about the rows it
# fills, in forwards of this many rows, and the shape stays the same whatever the number of rows.
_PREFILL_ROWS = 16
# How many decode steps the group schedule runs between checks (one host sync each) of whether
# every row has finished.
_DONE_CHECK_INTERVAL = 16
# Under "refill", the decode steps between refill points, where finished rows take the next pending
# samples: 8 was the fastest of 2, 4, 8 and 16 in the rollout benchmark on an H200 (docs/performance.md).
_REFILL_EVERY = 8
# An episode's continuation feeds its appended ids one decode step each, or, from this many on, by
# forwards of this many positions (of every row, like a prefill): a forward costs a few decode
# steps of the whole batch, a decode step of a row only that row's time.
_EXTEND_CHUNK = 16


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature=0`` is greedy (argmax; the filters do not apply)."""

    temperature: float = 1.0
    """Divides the logits before the softmax; 0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p (nucleus)."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely token's probability."""
    max_new_tokens: int = 128
    """Generated tokens per sample at most (fewer where the context ends first)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a sample (e.g. EOS, <|im_end|>); the stop token is kept in the output."""
    num_beams: int = 1
    """1 samples (or, at temperature 0, decodes greedily); N > 1 searches N greedy beams (models/generation/beam.py)."""
    length_penalty: float = 1.0
    """Beam search: a finished beam's score is its summed log-probs / its length ** length_penalty."""
    early_stopping: bool | Literal["never"] = False
    """Beam search: when a prompt's search ends once it holds num_beams finished beams (models/generation/beam.py)."""

    def __post_init__(self) -> None:
        checks = (
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, ">= 0"),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
            ("num_beams", isinstance(self.num_beams, int) and self.num_beams >= 1, "an integer >= 1"),
            ("length_penalty", math.isfinite(self.length_penalty), "finite"),
            ("early_stopping", self.early_stopping in (False, True, "never"), "False, True or 'never'"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(
                    f"sampling {name} must be {expected}, got {getattr(self, name)!r}", key=f"sampling.{name}"
                )
        if self.num_beams > 1 and not (self.greedy and not self.filtered):
            raise ConfigError(
                f"sampling num_beams={self.num_beams} searches greedy beams and samples nothing, but temperature="
                f"{self.temperature}, top_k={self.top_k}, top_p={self.top_p}, min_p={self.min_p} ask to sample",
                key="sampling.num_beams", hint="set temperature to 0 and leave top_k, top_p and min_p off, "
                "or use num_beams=1 to sample")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """Whether any of top_k, top_p, min_p removes tokens."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


@dataclass(frozen=True)
class SampleKey:
    """The identity of one sample, and so of all its randomness (docs/contracts.md).

    ``purpose`` names the consumer (e.g. "grpo.rollout", "cli"), ``step`` the training step
    (0 outside training), ``prompt_index`` the prompt's index in its data set or file (not
    its position in a batch) and ``sample_index`` which of several samples of that prompt.
    """

    seed: int
    purpose: str
    step: int
    prompt_index: int
    sample_index: int = 0

    def stream(self) -> int:
        """A 64-bit integer that depends on every field and nothing else."""
        text = f"{self.seed}:{self.purpose}:{self.step}:{self.prompt_index}:{self.sample_index}".encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")

    def uniforms(self, count: int) -> np.ndarray:
        """``count`` uniforms in [0, 1), float32, one per generated position (counter-based)."""
        return counter_uniforms(np.array([self.stream()], dtype=np.uint64), count)[0]


def counter_uniforms(streams: np.ndarray, count: int) -> np.ndarray:
    """(N,) uint64 streams -> (N, count) float32 uniforms in [0, 1): splitmix64(stream + (t+1)*golden).

    Pure integer arithmetic (numpy uint64 wraps modulo 2^64), so the numbers are the same on
    every machine; each uses the top 24 bits, exactly representable in float32.
    """
    golden = np.uint64(0x9E3779B97F4A7C15)
    counters = np.arange(1, count + 1, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        x = streams[:, None] + counters * golden
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return ((x >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)).astype(np.float32)


@dataclass(frozen=True)
class Sample:
    """One generated continuation."""

    tokens: list[int]
    """Generated token ids (the prompt excluded; a stop token included)."""
    logprobs: list[float]
    """The model's untempered log-probability of each generated token."""
    finish_reason: FinishReason
    """'stop' (a stop token was generated) or 'length' (max_new_tokens or the context ran out)."""
    routing: Optional[torch.Tensor] = None
    """(prompt + generated tokens, layers, top_k) int16: each token's experts where the model's spec declares a
    routing to record (models/generation/routing_record.py; -1: none); None otherwise."""


@dataclass(frozen=True)
class TurnEnd:
    """A turn of an episode that has ended (``Sampler.generate_episodes``)."""

    episode: int
    """The episode's index in the call."""
    turn: int
    """0 for the first turn."""
    sample: Sample
    """The ids the turn sampled, their log-probs, and why it ended."""


@dataclass(frozen=True)
class Continuation:
    """How an episode goes on after a turn: its whole sequence now, and the next turn's budget."""

    ids: Sequence[int]
    """The episode's ids so far (the prompt, every earlier turn and appended ids, then a prefix of
    the turn just sampled, usually all of it) followed by the ids to append (an observation)."""
    budget: int
    """The next turn samples at most this many ids (and at most max_new_tokens, and never past max_len)."""


def sample_next(
    logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams, *, cut: Callable = nucleus_cut,
    draw: Callable = draw_kept, token_logprobs: Callable = stock_token_logprobs, never: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, vocab), uniforms (B,) -> (tokens (B,) int64, untempered log-probs (B,) fp32).

    Every operation is row-wise, so a row's token depends on its own logits and uniform only.
    Sampling inverts the CDF at the uniform over the kept tokens in vocabulary order (a filter
    zeroes the weights of the tokens it removes), so ``top_p=1`` draws what no filter draws.
    ``cut`` finds top-p's cut and ``draw`` inverts the CDF over the tokens a cut keeps: the
    torch references (``nucleus_cut``, ``draw_kept``) or, on CUDA, the Triton kernels
    (``nucleus_cut_cuda``, ``draw_kept_cuda``); top-k and min-p go through a kept mask in torch.
    ``token_logprobs(logits, tokens)`` gives the log-probs (``Numerics.token_logprobs``: under
    ``batch_invariant`` the function the trainer's log-probs read). ``never`` ((vocab,) bool): tokens
    never drawn (``GenerationSpec.never_sampled``); the log-probs are still the unmasked logits'.
    """
    logits = logits.to(torch.float32)
    drawn = logits if never is None else logits.masked_fill(never, float("-inf"))
    if params.greedy:
        tokens = drawn.argmax(dim=-1)
    else:
        probs = F.softmax(drawn / params.temperature, dim=-1)
        steps = (uniforms.to(torch.float64) * 2**UNIFORM_BITS).to(torch.int64)  # exact: u = k / 2^24
        if params.top_k > 0 or params.min_p > 0:
            tokens = inverse_cdf(fixed_point(probs) * _kept(probs, params, cut), steps)
        elif params.top_p < 1:
            tokens = draw(probs, *cut(probs, params.top_p), steps)
        else:  # cut -1 keeps every token
            rows = probs.shape[0]
            everything = torch.full((rows, 1), -1, dtype=torch.int32, device=probs.device)
            tokens = draw(probs, everything, torch.zeros(rows, 1, dtype=torch.int64, device=probs.device), steps)
    return tokens, token_logprobs(logits, tokens)


def _kept(probs: torch.Tensor, params: SamplingParams, cut: Callable) -> torch.Tensor:
    """(B, vocab) bool: the tokens the filters keep.

    Each filter keeps a prefix of the tokens ranked by descending probability, ties by
    ascending id (as a stable sort ranks them), and the kept set is the shortest of those
    prefixes. A prefix is found without sorting: every token more likely than a cut
    probability plus the first few (by id) of the tokens exactly at it (models/generation/nucleus.py).
    """
    bits = probs.view(torch.int32)
    keep = torch.ones_like(bits, dtype=torch.bool)
    if 0 < params.top_k < probs.shape[-1]:
        at = probs.topk(params.top_k, dim=-1).values[:, -1:].view(torch.int32)  # the k-th probability
        keep &= _prefix(bits, at, params.top_k - (bits > at).sum(dim=-1, keepdim=True))
    if params.top_p < 1:
        keep &= _prefix(bits, *cut(probs, params.top_p))
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.amax(dim=-1, keepdim=True)
    return keep


class MediaPrompt(list):
    """A prompt's token ids (the list itself) and the media its tokens show (``media``: per media field,
    the prompt's items, as one row of ``Batch.media``), which its prefill hands the model
    (``GenerationModel.prompt_media``, models/generation/protocol.py)."""

    def __init__(self, ids: Sequence[int], media: Mapping[str, Sequence[Any]]) -> None:
        super().__init__(ids)
        self.media = media


def _prefix(bits: torch.Tensor, at: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """The tokens above probability bits ``at`` (B, 1), and the first ``ties`` (B, 1) of those at it."""
    tied = bits == at
    return (bits > at) | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= ties))


class Sampler:
    """Generates continuations of token-id prompts with a plain ``GenerationModel`` (models/generation/protocol.py).

    The model is used as it is (its device and dtype; put it in eval mode yourself if it
    has any train-only behaviour), under its own ``Numerics``: the sampling rule's kernels are
    the ones it picks. For a sharded (FSDP2/TP) or DDP
    model, pass ``training.rollout.generation_model.generation_model(model)``'s result. ``max_len`` bounds prompt plus
    generated tokens of one sample; ``max_batch`` is the number of rows every forward
    runs (cache rows).

    ``schedule`` says how a call with more samples than rows goes through them: "refill"
    (default) starts the next pending sample in a row as soon as the row's sample has
    finished (models/generation/scheduler.py), so a call costs about its mean completion length,
    not its longest; "groups" runs them max_batch at a time, each group until its longest
    sample ends (the schedule before refill, kept to check and measure refill against).
    Both give every sample bitwise the same tokens and log-probs. ``refill_every`` is the
    number of decode steps between refill points (one host sync and, where rows are free
    and samples pending, a prefill of the free rows, ``prefill_rows`` per forward): fewer
    points cost fewer host syncs and prefill forwards, more leave finished rows idle for fewer
    steps. A point sees the rows done one step before it (``scheduler.done_lag``), so the
    device runs that step while the host waits. It changes no sample. ``prefill_ahead``
    (default: on CUDA) keeps the prompts of the next pending samples prefilled in a staging
    pool of ``2 * prefill_rows`` cache rows (``scheduler.StagingPool``): a refill point copies
    them into its free rows (prefilling at the point only the rows beyond them) and prefills
    the next ones into the slots it freed, for the points to come, on CUDA on a stream of its
    own, so that they run beside the decode steps (whose small kernels leave most of the
    device free) instead of between them. Every prompt is prefilled once. It changes no
    sample either; the pool costs ``2 * prefill_rows`` rows of keys/values. ``prefill_rows``
    (default: 16, at most max_batch) is the rows of every prefill forward: a shape, so it is one
    of the settings a sample depends on.

    ``compile`` (default: on CUDA, but not under ``Numerics.batch_invariant``) compiles the decode
    step with static shapes; ``cuda_graphs`` (default: with compile on CUDA, and under
    ``batch_invariant`` on CUDA for a model without experts, ``eager_graphs``) replays it as a CUDA
    graph: torch.compile's where compiled, else the eager forward's launches, captured once.
    """

    def __init__(
        self,
        model: GenerationModel,
        *,
        max_batch: int,
        max_len: int,
        prefill_chunk: int = 128,
        prefill_rows: Optional[int] = None,
        schedule: Schedule = "refill",
        refill_every: int = _REFILL_EVERY,
        prefill_ahead: Optional[bool] = None,
        compile: Optional[bool] = None,
        cuda_graphs: Optional[bool] = None,
    ) -> None:
        # FSDP2 keeps the class (a subclass of it), so the parameters tell a sharded model apart.
        spec = check_plain(model)
        prefill_rows = min(max_batch, _PREFILL_ROWS) if prefill_rows is None else prefill_rows
        for name, value in (("max_batch", max_batch), ("max_len", max_len), ("prefill_chunk", prefill_chunk),
                            ("prefill_rows", prefill_rows), ("refill_every", refill_every)):
            if value < 1:
                raise ConfigError(f"sampler {name} must be >= 1, got {value}", key=f"sampler.{name}")
        if prefill_rows > max_batch:
            raise ConfigError(f"sampler prefill_rows ({prefill_rows}) must be at most max_batch ({max_batch})",
                              key="sampler.prefill_rows")
        if schedule not in ("refill", "groups"):
            raise ConfigError(f"sampler schedule must be 'refill' or 'groups', got {schedule!r}",
                              key="sampler.schedule")
        if max_len < 2:
            raise ConfigError(f"sampler max_len must be >= 2 (a prompt token and a new one), got {max_len}",
                              key="sampler.max_len")
        self.model = model
        self.spec = spec
        self.numerics = model.numerics
        self.max_batch = max_batch
        self.max_len = max_len
        self.schedule = schedule
        self.refill_every = refill_every
        self.prefill_chunk = min(prefill_chunk, max_len)
        # Episodes' appended ids of at least this many go in by chunks of it (generate_episodes); it
        # divides prefill_chunk, so aligned chunks never leave the cache's slots.
        self.extend_chunk = math.gcd(_EXTEND_CHUNK, self.prefill_chunk)
        self.device, self.dtype = spec.device, spec.dtype
        on_cuda = self.device.type == "cuda"
        self.prefill_ahead = on_cuda if prefill_ahead is None else prefill_ahead
        # Where prompts are prefilled ahead on CUDA: their stream, beside the decode steps'.
        self._side = torch.cuda.Stream(self.device) if on_cuda and self.prefill_ahead else None
        # The batch-invariant kernels (models/batch_invariant.py) run eagerly: their function mode
        # is not one torch.compile traces. Their launches are captured as a graph instead.
        self.compile = (on_cuda and not self.numerics.batch_invariant) if compile is None else compile
        if cuda_graphs is None:
            cuda_graphs = on_cuda and (self.compile or eager_graphs(model))
        self.cuda_graphs = cuda_graphs
        # Slots rounded up to whole prefill chunks: chunk positions never leave the cache.
        slots = math.ceil(max_len / self.prefill_chunk) * self.prefill_chunk
        self.prefill_rows = prefill_rows
        with torch.no_grad():
            self.cache = cache_for(spec, batch=max_batch, slots=slots)
            # Prompts are prefilled here, prefill_rows at a time, and their rows copied into the cache.
            self.prefill_cache = cache_for(spec, batch=prefill_rows, slots=slots)
            # Prompts prefilled ahead wait here (StagingPool) for the refill points that take them.
            self.pool = cache_for(spec, batch=2 * prefill_rows, slots=slots) if self.prefill_ahead else None
        if self.compile and self.cuda_graphs:
            for buffer in self.cache.tensors() + self.prefill_cache.tensors():
                torch._dynamo.mark_static_address(buffer)
            for cache in (self.cache, self.prefill_cache):
                torch._dynamo.mark_static_address(cache.position_offsets)
        self._decode_steps: dict[SamplingParams, Callable] = {}
        self._decode_logits_forward: Optional[Callable] = None  # beam search's decode step (_decode_logits)
        self._prefill_chunk_forward: Optional[Callable] = None
        # The refill schedule's rows and stop table, kept from call to call (reset by each), and its
        # whole decode steps, by sampling rule: with CUDA graphs, each a graph that reads and writes them.
        self._rows: Optional[RowState] = None
        self._stops = torch.zeros(spec.vocab_size, dtype=torch.bool, device=self.device)
        # The tokens the rule never draws (the model's GenerationSpec.never_sampled); None: any.
        self._never = None
        if spec.never_sampled:
            self._never = torch.zeros(spec.vocab_size, dtype=torch.bool, device=self.device)
            self._never[list(spec.never_sampled)] = True
        self._refill_steps: dict[SamplingParams, Callable[[], None]] = {}

    # ------------------------------------------------------------------ public

    def generate(
        self, prompts: Sequence[Sequence[int]], keys: Sequence[SampleKey], params: SamplingParams,
        media: Optional[Sequence[Optional[Mapping[str, Sequence[Any]]]]] = None,
    ) -> list[Sample]:
        """One sample per (prompt, key) pair, in the order given.

        A prompt may appear several times with different keys (several samples of it).
        ``media[i]`` (None: text only) is what prompt i's tokens show, per media field its items
        (images: ``pixel_values`` and ``image_grid_thw``), read once by its prefill through the
        model's ``prompt_media``; the decode steps are text. Raises DataError naming the prompt
        index for an empty prompt, a prompt that leaves no room for a new token within max_len,
        or a token id outside the vocabulary.
        """
        if len(prompts) != len(keys):
            raise ConfigError(f"generate got {len(prompts)} prompts but {len(keys)} keys; pass one key per prompt")
        rows = self._checked_prompts(prompts, media)
        with torch.no_grad():
            if params.num_beams > 1:
                from models.generation.beam import beam_search

                return beam_search(self, rows, list(keys), params)
            if self.schedule == "refill":
                return self._generate_refill(rows, list(keys), params)
            samples: list[Sample] = []
            for start in range(0, len(rows), self.max_batch):
                group = slice(start, start + self.max_batch)
                samples.extend(self._generate_group(rows[group], list(keys[group]), params))
        return samples

    def generate_episodes(
        self, prompts: Sequence[Sequence[int]], key_of: Callable[[int, int], SampleKey], params: SamplingParams,
        on_turns: Callable[[list[TurnEnd]], Sequence[Optional[Continuation]]],
        budgets: Optional[Sequence[int]] = None,
        media: Optional[Sequence[Optional[Mapping[str, Sequence[Any]]]]] = None,
    ) -> None:
        """Multi-turn episodes, each kept in one cache row from its prompt to its end.

        Episode ``e`` starts from ``prompts[e]``; its turn ``t`` samples with ``key_of(e, t)``'s
        uniforms at most ``budgets[e]`` ids (turn 0; default max_new_tokens). At every refill
        point the turns that have ended go to ``on_turns`` in one list (by row); for each it
        answers a ``Continuation`` (the episode goes on) or None (it is over: its row takes the
        next pending episode, with a prefill). A continued row feeds the ids its cache does not
        hold through the decode step (forced steps: their keys/values are written, nothing is
        sampled; ``extend_chunk`` ids or more by chunked forwards, ``_extend``) and then samples
        the next turn: the ids before the turn are never computed again, and the decode step
        runs at no new shape (no recompilation).

        A turn's ids and log-probs depend only on its episode's prompt, appended ids and keys,
        and the sampler's settings: not on the other episodes, how many there are, their order
        or which row it runs in. Turn 0 is the sample ``generate`` gives for ``key_of(e, 0)``
        (the same prefill and decode steps); later turns differ from a ``generate`` call on the
        whole sequence in the last bits (the earlier ids' keys/values come from decode steps,
        not from a chunked prefill). Raises DataError (naming the episode) for a bad prompt
        or a continuation that does not extend the episode or leaves no room within max_len.
        ``media`` is each prompt's, as ``generate`` takes it; appended ids are text.
        """
        if self.spec.routing is not None:
            raise ConfigError("the sampler records a routing for replay per single-turn sample, not across an "
                              "episode's turns",
                              hint="turn the model's routing replay (model.<arch>.routing_replay) off for episodes")
        if params.num_beams > 1:
            raise ConfigError(f"generate_episodes samples its turns; it does not search beams "
                              f"(num_beams={params.num_beams})", key="sampling.num_beams",
                              hint="use num_beams=1 for episodes")
        rows = self._checked_prompts(prompts, media)
        budgets = [params.max_new_tokens] * len(rows) if budgets is None else [int(b) for b in budgets]
        if len(budgets) != len(rows):
            raise ConfigError(f"generate_episodes got {len(rows)} prompts but {len(budgets)} budgets")
        with torch.no_grad():
            self._play(rows, key_of, params, on_turns, budgets)

    # ------------------------------------------------------------------ internals

    def _checked_prompts(self, prompts: Sequence[Sequence[int]],
                         media: Optional[Sequence[Optional[Mapping[str, Sequence[Any]]]]]) -> list[list[int]]:
        """Each prompt's ids, checked (``_checked_prompt``); a ``MediaPrompt`` where it has media."""
        rows = [self._checked_prompt(i, prompt) for i, prompt in enumerate(prompts)]
        if media is None:
            return rows
        if len(media) != len(rows):
            raise ConfigError(f"the sampler got {len(rows)} prompts but {len(media)} media entries; "
                              "pass one per prompt (None for a text prompt)")
        if any(m is not None for m in media) and not callable(getattr(self.model, "prompt_media", None)):
            raise ConfigError(f"{type(self.model).__name__} reads text prompts only, but prompts carry media",
                              key="model.arch", hint="generate from text prompts, or with a family that reads media")
        return [row if m is None else MediaPrompt(row, m) for row, m in zip(rows, media)]

    def _checked_prompt(self, index: int, prompt: Sequence[int]) -> list[int]:
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise DataError(f"prompt {index} is empty", record=index,
                            hint="give every prompt at least one token (e.g. BOS or a chat template's header)")
        if len(tokens) >= self.max_len:
            raise DataError(
                f"prompt {index} has {len(tokens)} tokens, which leaves no room for a new one "
                f"within the sampler's max_len={self.max_len}",
                record=index, hint="shorten the prompt or raise max_len",
            )
        vocab = self.spec.vocab_size
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise DataError(f"prompt {index} holds token id {bad}, outside the vocabulary [0, {vocab})",
                            record=index, hint="tokenize with the model's own tokenizer")
        return tokens

    def _generate_group(self, prompts: list[list[int]], keys: list[SampleKey], params: SamplingParams) -> list[Sample]:
        rows, batch, device = len(prompts), self.max_batch, self.device
        lengths = [len(p) for p in prompts] + [1] * (batch - rows)  # padding rows: one token
        budgets = [min(params.max_new_tokens, self.max_len - n) for n in lengths[:rows]]
        steps = max(budgets)
        self._prefill(list(range(rows)), prompts)

        streams = np.array([k.stream() for k in keys] + [0] * (batch - rows), dtype=np.uint64)
        # (steps, B): row t is contiguous, so the compiled step sees the same strides whatever `steps` is.
        uniforms = torch.from_numpy(counter_uniforms(streams, steps).T.copy()).to(device)
        last = torch.tensor([p[-1] for p in prompts] + [0] * (batch - rows), device=device)
        start = torch.tensor([n - 1 for n in lengths], device=device)  # position of the last prompt token
        budget = torch.tensor(budgets + [0] * (batch - rows), device=device)
        stops = self._stop_table(params)
        out_tokens = torch.zeros(batch, steps, dtype=torch.long, device=device)
        out_logprobs = torch.zeros(batch, steps, dtype=torch.float32, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        done[rows:] = True
        decode = self._decode_step(params)
        token = last[:, None]  # (B, 1)
        for t in range(steps):
            # A finished row keeps stepping (static shapes) at a clamped position; its output is ignored.
            positions = (start + t).clamp(max=self.cache.slots - 1)[:, None]  # (B, 1)
            next_token, logprob = decode(token, positions, uniforms[t])
            out_tokens[:, t] = next_token
            out_logprobs[:, t] = logprob
            token = next_token[:, None].clone()  # the graph's output buffer is reused by its next replay
            done |= stops[next_token] | (t + 1 >= budget)
            if (t + 1) % _DONE_CHECK_INTERVAL == 0 and bool(done.all()):
                break
        samples = _collect(out_tokens[:rows].tolist(), out_logprobs[:rows].tolist(), budgets, params.stop_token_ids)
        return samples if self.spec.routing is None else self.cache.with_routing(samples, prompts)

    def _generate_refill(self, prompts: list[list[int]], keys: list[SampleKey], params: SamplingParams) -> list[Sample]:
        """Every sample through the max_batch cache rows, a finished row taking the next pending sample.

        A refill point waits for the device once, to read which rows are done; everything else it
        sends or fetches is a copy queued behind the decode steps (page-locked host memory): the
        finished rows' outputs come back by the next refill point, where they are collected.
        """
        budgets = [min(params.max_new_tokens, self.max_len - len(p)) for p in prompts]
        if not prompts:
            return []
        width = max(budgets)
        slots, state = RowSlots(self.max_batch, len(prompts)), self._row_state()
        pool = StagingPool(self.pool.batch, self.prefill_rows) if self.pool is not None else None
        self._stops.copy_(self._stop_table(params))
        decode = self._refill_step(params)  # before any row is filled: capturing it runs one step
        samples: list[Optional[Sample]] = [None] * len(prompts)
        # (samples, tokens, log-probs, their rows' routing records or None)
        in_flight: list[tuple[list[int], torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = []

        def landed() -> None:  # the rows handed back at the last refill point: their copies are on the host
            for indices, tokens, logprobs, records in in_flight:
                ended = _collect(tokens.tolist(), logprobs.tolist(), [budgets[i] for i in indices],
                                 params.stop_token_ids)
                if records is not None:  # routing replay (models/generation/routing_record.py)
                    ended = with_routing(ended, [prompts[i] for i in indices], records)
                for i, sample in zip(indices, ended):
                    samples[i] = sample

        # A point's done flags are fetched done_lag steps before it, so that the device still has a
        # step to run while the host waits for them and queues the point's work.
        every, lag = self.refill_every, done_lag(self.refill_every)
        flags: dict[int, tuple[torch.Tensor, Callable[[], None]]] = {}  # point -> (done, wait)
        # The step by which each row has surely finished (its budget's end): not seen late.
        ends_by = np.zeros(self.max_batch, dtype=np.int64)
        step = 0
        while True:
            if step % every == 0:  # a refill point: one wait for the device, a step behind it
                with torch.profiler.record_function("sampler.refill_point"):
                    finished = ends_by <= step  # at step 0 every row: free
                    if step:
                        done, landing = flags.pop(step)
                        with torch.profiler.record_function("sampler.done_flags"):  # the copies in flight land too
                            landing()
                        finished |= done.numpy()
                    handed_back, assigned = slots.refill(finished)
                    for row, sample in assigned:
                        ends_by[row] = step + budgets[sample]
                    records = self._routing_records(handed_back)  # before the refill rewrites these rows
                    if assigned:  # first, so that the device works while the host collects
                        taken = pool.take([sample for _, sample in assigned]) if pool is not None else []
                        self._refill(state, assigned, prompts, keys, budgets, taken, width)
                    # Fetched after the refill's kernels but before the next decode step writes these rows.
                    handing = [(*self._hand_back(state, handed_back, width), records)] if handed_back else []
                    # The next pending prompts, for the points to come: staged once the next step is queued.
                    groups = pool.next_groups(slots.pending) if pool is not None else []
                if not slots.busy:
                    landed()
                    in_flight = handing
                    break
            decode()
            if step % every == 0:  # the point's work that can wait until the device has a step to run
                landed()
                in_flight = handing
                if groups:
                    self._stage([([prompts[i] for i in samples], rows) for samples, rows in groups])
            step += 1
            if (step + lag) % every == 0:
                flags[step + lag] = _fetch(state.done)
        self._await_staged()
        _synchronize(self.device)
        landed()
        return samples

    def _hand_back(self, state: RowState, handed_back: list[tuple[int, int]],
                   width: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """(samples, tokens (k, width), log-probs) of the finished (row, sample) pairs, on their way to the host."""
        (rows,) = upload([np.array([row for row, _ in handed_back], dtype=np.int64)], self.device)
        tokens, logprobs = state.outputs(rows, width)
        return [sample for _, sample in handed_back], _to_host(tokens), _to_host(logprobs)

    def _routing_records(self, handed_back: list[tuple[int, int]]) -> Optional[torch.Tensor]:
        """The finished rows' routing records (k, slots, layers, top_k), on their way to the host; None where
        the model records none or no row finished."""
        if self.spec.routing is None or not handed_back:
            return None
        rows = torch.tensor([row for row, _ in handed_back], device=self.device)
        return _to_host(self.cache.routing[rows])

    def _refill(self, state: RowState, assigned: list[tuple[int, int]], prompts: list[list[int]],
                keys: list[SampleKey], budgets: list[int], taken: list[int], width: int) -> None:
        """Put the assigned (row, sample) pairs' prompts into their rows and start them decoding.

        ``taken``: the staging pool's slots that hold the first ``len(taken)`` assigned samples'
        prompts (prefilled ahead); they are copied into their rows, and the others are prefilled now.
        """
        rows, indices = [row for row, _ in assigned], [sample for _, sample in assigned]
        held = len(taken)
        if held:
            self._await_staged()
            self._copy_rows(self.cache, self.pool, rows[:held], taken)
        if len(rows) > held:
            self._prefill(rows[held:], [prompts[i] for i in indices[held:]])
        streams = np.array([keys[i].stream() for i in indices], dtype=np.uint64)
        index, last, start, budget = upload([np.array(rows), np.array([prompts[i][-1] for i in indices]),
                                              np.array([len(prompts[i]) - 1 for i in indices]),
                                              np.array([budgets[i] for i in indices])], self.device, np.int64)
        (uniforms,) = upload([counter_uniforms(streams, width)], self.device)
        state.load(index, last, start, budget, uniforms)

    def _play(self, prompts: list[list[int]], key_of: Callable[[int, int], SampleKey], params: SamplingParams,
              on_turns: Callable[[list[TurnEnd]], Sequence[Optional[Continuation]]], budgets: list[int]) -> None:
        """``generate_episodes``: episodes through the max_batch rows, continued in their rows' caches."""
        if not prompts:
            return
        slots = RowSlots(self.max_batch, len(prompts))
        state = EpisodeRows(self.max_batch, params.max_new_tokens, self.cache.slots, self.device)
        stops = self._stop_table(params)
        decode = self._decode_step(params)
        held: list[Optional[list[int]]] = [None] * self.max_batch  # each row's ids before its current turn
        # The step by which each row's turn has surely ended (its forced steps, then its whole budget):
        # a refill point comes there at the latest, so a turn that runs to its budget waits for no
        # regular point.
        ends_by = np.full(self.max_batch, np.iinfo(np.int64).max, dtype=np.int64)
        turn_of = [0] * len(prompts)
        step = point = 0
        while True:
            if step == point:  # a refill point: one host sync
                done = state.done.cpu().numpy()
                ended = [row for row, episode in enumerate(slots.occupant) if episode is not None and done[row]]
                over = np.zeros(self.max_batch, dtype=bool)
                if ended:
                    over[self._turns_ended(state, ended, slots.occupant, held, turn_of, key_of, params, on_turns,
                                           ends_by, step)] = True
                _, assigned = slots.refill(over)
                if assigned:
                    self._begin(state, assigned, prompts, held, key_of, params, budgets, ends_by, step)
                if not slots.busy:
                    return
                busy = [row for row, episode in enumerate(slots.occupant) if episode is not None]
                point = min(step + self.refill_every, int(ends_by[busy].min()))
            next_token, logprob = decode(*state.inputs())
            state.advance(next_token, logprob, stops)
            step += 1

    def _turns_ended(self, state: EpisodeRows, ended: list[int], occupant: list[Optional[int]],
                     held: list[Optional[list[int]]], turn_of: list[int], key_of: Callable[[int, int], SampleKey],
                     params: SamplingParams, on_turns: Callable, ends_by: np.ndarray, step: int) -> list[int]:
        """Hand the ended turns of ``ended`` rows to ``on_turns``, start the continued ones' next
        turns, and return the rows whose episodes are over."""
        tokens, logprobs = state.turns(ended)
        samples = _collect(tokens, logprobs, [len(t) for t in tokens], params.stop_token_ids)
        episodes = [occupant[row] for row in ended]
        answers = list(on_turns([TurnEnd(e, turn_of[e], s) for e, s in zip(episodes, samples)]))
        if len(answers) != len(ended):
            raise ConfigError(f"on_turns answered {len(answers)} of {len(ended)} ended turns; answer each")
        over, rows, sequences, positions, budgets, streams = [], [], [], [], [], []
        for row, episode, turn_ids, answer in zip(ended, episodes, tokens, answers):
            if answer is None:
                over.append(row)
                continue
            before = held[row]
            sampled = before + turn_ids
            if list(answer.ids[: len(before)]) != before:
                raise DataError(f"episode {episode}'s continuation after turn {turn_of[episode]} does not start "
                                "with the episode's ids before that turn", record=episode,
                                hint="continue an episode with its ids so far followed by the appended ids")
            ids = before + [int(t) for t in answer.ids[len(before):]]
            common = len(before)
            while common < min(len(ids), len(sampled)) and ids[common] == sampled[common]:
                common += 1
            self._checked_continuation(episode, turn_of[episode], ids, answer.budget)
            turn_of[episode] += 1
            held[row] = ids
            rows.append(row)
            sequences.append(ids)
            # The cache holds every id the row has fed: all but the turn's last sampled id.
            positions.append(min(len(sampled) - 1, common, len(ids) - 1))
            budgets.append(min(answer.budget, params.max_new_tokens, self.max_len - len(ids)))
            streams.append(key_of(episode, turn_of[episode]).stream())
        # A row with at least extend_chunk ids to feed before it samples takes them in chunks
        # (a rule of the row's own ids, so which rows share the forward changes nothing).
        extended = [i for i, (ids, p) in enumerate(zip(sequences, positions)) if len(ids) - 1 - p >= self.extend_chunk]
        if extended:
            self._extend([rows[i] for i in extended], [sequences[i] for i in extended],
                         [positions[i] for i in extended])
            for i in extended:
                positions[i] = len(sequences[i]) - 1
        for row, ids, position, budget in zip(rows, sequences, positions, budgets):
            ends_by[row] = step + (len(ids) - 1 - position) + budget
        if rows:
            state.start(rows, sequences, positions, budgets,
                        counter_uniforms(np.array(streams, dtype=np.uint64), state.width))
        return over

    def _extend(self, rows: list[int], sequences: list[list[int]], positions: list[int]) -> None:
        """Write the keys/values of each row's ids from its position up to its last id (which the
        decode step feeds) by forwards of all max_batch rows, ``extend_chunk`` positions each, at
        positions aligned to multiples of extend_chunk: a row's first chunk starts at the multiple
        at or before its position (the ids of that chunk before the position are written again).
        Rows not extended, and extended rows past their last chunk, write into the scratch row."""
        batch, chunk = self.max_batch, self.extend_chunk
        spans = [(p // chunk, (len(ids) - 2) // chunk) for ids, p in zip(sequences, positions)]
        for k in range(max(last - first + 1 for first, last in spans)):
            ids = torch.zeros(batch, chunk, dtype=torch.long)
            starts = torch.zeros(batch, 1, dtype=torch.long)
            fill = torch.zeros(batch, dtype=torch.bool)
            for row, sequence, (first, last) in zip(rows, sequences, spans):
                if first + k <= last:
                    start = (first + k) * chunk
                    part = sequence[start: start + chunk]
                    ids[row, : len(part)] = torch.tensor(part)
                    starts[row, 0], fill[row] = start, True
            positions_k = (starts + torch.arange(chunk)[None, :]).to(self.device)
            self._forward(ModelInputs(ids.to(self.device), positions_k), self.cache.redirected(fill.to(self.device)))

    def _checked_continuation(self, episode: int, turn: int, ids: list[int], budget: int) -> None:
        where = f"episode {episode}'s continuation after turn {turn}"
        if len(ids) >= self.max_len:
            raise DataError(f"{where} has {len(ids)} ids, which leaves no room for a new one within the sampler's "
                            f"max_len={self.max_len}", record=episode,
                            hint="end the episode (answer None) before it fills the context, or raise max_len")
        vocab = self.spec.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise DataError(f"{where} holds token id {bad}, outside the vocabulary [0, {vocab})", record=episode,
                            hint="tokenize appended ids with the model's own tokenizer")
        if budget < 1:
            raise DataError(f"{where} has budget {budget}, below 1", record=episode,
                            hint="end the episode (answer None) instead")

    def _begin(self, state: EpisodeRows, assigned: list[tuple[int, int]], prompts: list[list[int]],
               held: list[Optional[list[int]]], key_of: Callable[[int, int], SampleKey], params: SamplingParams,
               budgets: list[int], ends_by: np.ndarray, step: int) -> None:
        """Prefill the assigned (row, episode) pairs' prompts into their rows and start their first turns."""
        rows, episodes = [row for row, _ in assigned], [episode for _, episode in assigned]
        for row, episode in assigned:
            held[row] = prompts[episode]
        self._prefill(rows, [prompts[e] for e in episodes])
        streams = np.array([key_of(e, 0).stream() for e in episodes], dtype=np.uint64)
        first = [max(1, min(budgets[e], params.max_new_tokens, self.max_len - len(prompts[e]))) for e in episodes]
        state.start(rows, [prompts[e] for e in episodes], [len(prompts[e]) - 1 for e in episodes], first,
                    counter_uniforms(streams, state.width))
        ends_by[rows] = step + np.array(first)

    def _stop_table(self, params: SamplingParams) -> torch.Tensor:
        """(vocab,) bool on the device: which sampled ids end a sample. A lookup, not ``torch.isin``,
        whose sort-based path (more than a handful of stop ids) waits for the device every step."""
        table = torch.zeros(self.spec.vocab_size, dtype=torch.bool)
        ids = [t for t in params.stop_token_ids if 0 <= t < len(table)]  # others are never sampled
        table[ids] = True
        return table.to(self.device)

    def _prefill(self, rows: list[int], prompts: list[list[int]]) -> None:
        """Write keys/values of every prompt token but the last into cache row ``rows[i]`` of ``prompts[i]``.

        By forwards of one fixed shape, ``prefill_rows`` rows (the prompts in their order, the
        last group padded with dummy rows) by ``prefill_chunk`` positions, into the prefill
        cache; then each group's rows are copied into their cache rows. So a prefill costs
        about the rows it fills, and the other rows' caches keep what they hold. The ids go to
        the device in page-locked copies that do not wait for it, and the forwards are compiled
        like the decode step.
        """
        with torch.profiler.record_function("sampler.prefill"):
            self._await_staged()  # the prefill cache is rewritten here
            for first in range(0, len(rows), self.prefill_rows):
                self._prefill_group(prompts[first: first + self.prefill_rows])
                self._copy_prefilled(rows[first: first + self.prefill_rows])

    def _stage(self, groups: list[tuple[list[list[int]], list[int]]]) -> None:
        """Prefill each group's prompts (at most ``prefill_rows``) into the staging pool's slots, ahead of
        the refill points that take them: on CUDA on the side stream, after the work queued so far
        (the last readers of the prefill cache and of those slots), so that it runs beside the decode
        steps (whose small kernels leave most of the device free)."""
        with torch.profiler.record_function("sampler.prefill_ahead"):
            if self._side is not None:
                self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext():
                for prompts, slots in groups:
                    self._prefill_group(prompts)
                    self._copy_rows(self.pool, self.prefill_cache, slots)

    def _await_staged(self) -> None:
        """Work queued from here on (reading the staging pool, rewriting the prefill cache) waits for the
        prefills staged on the side stream."""
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    def _prefill_group(self, prompts: list[list[int]]) -> None:
        """Prefill up to ``prefill_rows`` prompts into the prefill cache's first rows (nothing to write
        where every prompt is one token), their position offsets 0 unless their media set them.

        Where a prompt carries media (``MediaPrompt``) the model reads the group's whole prompts
        and media once (``prompt_media``), and each chunk's forward gets what that returned; such a
        group's chunks run eagerly (ragged media have no static shape)."""
        group, chunk = self.prefill_rows, self.prefill_chunk
        self.prefill_cache.position_offsets.zero_()
        chunks = math.ceil((max(len(p) for p in prompts) - 1) / chunk)
        if chunks == 0:
            return
        ids = np.zeros((chunks * chunk, group), dtype=np.int64)  # (positions, rows), dummy rows all zeros
        for i, prompt in enumerate(prompts):
            ids[: len(prompt) - 1, i] = prompt[:-1]
        (ids,) = upload([ids.reshape(chunks, chunk, group).transpose(0, 2, 1)], self.device)  # (c, rows, chunk)
        media = self._prompt_media(prompts)
        if media is None:
            prefill_chunk = self._prefill_forward()
        else:
            def prefill_chunk(chunk_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
                return self._forward(ModelInputs(chunk_ids, positions, media=media), self.prefill_cache)
        for c in range(chunks):
            prefill_chunk(ids[c], torch.arange(c * chunk, (c + 1) * chunk, device=self.device).expand(group, chunk))

    def _prompt_media(self, prompts: list[list[int]]) -> Any:
        """What the model's ``prompt_media`` makes of a prefill group's whole prompts ((prefill_rows, T)
        ids, dummy rows one 0), their lengths and their media (per field, per row its items); None
        where no prompt of the group has media."""
        if not any(isinstance(p, MediaPrompt) for p in prompts):
            return None
        fields = sorted({name for p in prompts if isinstance(p, MediaPrompt) for name in p.media})
        rows = list(prompts) + [[0]] * (self.prefill_rows - len(prompts))
        ids = np.zeros((len(rows), max(len(p) for p in rows)), dtype=np.int64)
        for i, prompt in enumerate(rows):
            ids[i, : len(prompt)] = prompt
        media = {name: [[_on(item, self.device) for item in p.media.get(name, ())] if isinstance(p, MediaPrompt)
                        else [] for p in rows] for name in fields}
        lengths = torch.tensor([len(p) for p in rows], device=self.device)
        with self.numerics.sampler_autocast(self.device):  # the training forward's, as ``_forward``
            return self.model.prompt_media(torch.from_numpy(ids).to(self.device), lengths, media)

    def _copy_prefilled(self, rows: list[int]) -> None:
        """Copy the prefill cache's first ``len(rows)`` rows into cache rows ``rows``."""
        self._copy_rows(self.cache, self.prefill_cache, rows)

    def _copy_rows(self, target: KVCache, source: KVCache, rows: Sequence[int],
                   source_rows: Optional[Sequence[int]] = None) -> None:
        """``target``'s rows ``rows`` := ``source``'s rows ``source_rows`` (default its first ``len(rows)``):
        on CUDA one kernel for every layer's buffers (``KVCache.copy_rows``), the rows' indices sent
        in one page-locked copy that does not wait for the device."""
        sources = range(len(rows)) if source_rows is None else source_rows
        targets, sources = upload([np.asarray(rows), np.asarray(sources)], self.device, np.int64)
        target.copy_rows(source, targets, None if source_rows is None else sources)

    def _prefill_forward(self) -> Callable:
        """(ids (prefill_rows, prefill_chunk), positions (same)) -> the chunk's last logits (unused): one
        chunk's keys/values into the prefill cache.

        With CUDA graphs, a graph of its own (``CapturedGraph``: its own memory pool), not one of
        torch.compile's, whose graphs share a pool and must not run beside each other: it may run
        on the side stream while the decode step's graph runs.
        """
        if self._prefill_chunk_forward is not None:
            return self._prefill_chunk_forward

        def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return self._forward(ModelInputs(ids, positions), self.prefill_cache)

        if self.cuda_graphs:
            self._prefill_chunk_forward = CapturedGraph(
                torch.compile(forward, fullgraph=True, dynamic=False) if self.compile else forward)
        else:
            self._prefill_chunk_forward = self._compiled(forward)
        return self._prefill_chunk_forward

    def _compiled(self, forward: Callable) -> Callable:
        """A model forward of static shapes as the Sampler runs it: compiled where ``compile``, and
        replayed as a CUDA graph where ``cuda_graphs`` (torch.compile's, or without compile the eager
        forward captured, ``CapturedGraph``); as it is otherwise."""
        if not self.compile:
            return CapturedGraph(forward) if self.cuda_graphs else forward
        compiled = torch.compile(forward, mode="reduce-overhead" if self.cuda_graphs else "default",
                                 fullgraph=True, dynamic=False)
        if not self.cuda_graphs:
            return compiled

        def replayed(*inputs: torch.Tensor) -> torch.Tensor:
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(*inputs)

        return replayed

    def _row_state(self) -> RowState:
        """The refill schedule's rows, every one free (``RowState.reset``)."""
        if self._rows is None:
            # The longest budget a prompt (of at least one token) leaves within max_len.
            self._rows = RowState(self.max_batch, self.max_len - 1, self.device)
            if self.compile and self.cuda_graphs:
                self._rows.compile()
        self._rows.reset()
        return self._rows

    def _refill_step(self, params: SamplingParams) -> Callable[[], None]:
        """One decode step of the refill schedule's rows (``self._rows``, reset just before: no row filled).

        With CUDA graphs: the step's inputs from the rows' state, the model's forward, the
        sampling rule and the state's update, captured as one graph (``CapturedGraph``): one
        launch a step, where the rows' bookkeeping alone was a dozen small kernels. Capturing
        runs the step once; it writes position 0 of free rows' caches, which a prefill or the
        first step rewrites before anything reads it, and the state is reset after it.
        """
        key = _rule_key(params)
        if key in self._refill_steps:
            return self._refill_steps[key]
        state, stops, slots = self._rows, self._stops, self.cache.slots
        assert state is not None, "_row_state() first"
        if not self.cuda_graphs:
            decode = self._decode_step(params)

            def step() -> None:
                state.advance(*decode(*state.inputs(slots)), stops)
        else:
            logits = (torch.compile(self._decode_forward, fullgraph=True, dynamic=False) if self.compile
                      else self._decode_forward)
            rule = self._rule(key)

            def whole() -> None:
                tokens, positions, uniforms = state.inputs(slots)
                state.advance(*rule(logits(tokens, positions), uniforms), stops)

            step = CapturedGraph(whole)
            step.capture()
            state.reset()
        self._refill_steps[key] = step
        return step

    def _decode_forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The decode step's model forward: (B, 1) tokens and positions -> (B, vocab) logits, into ``cache``."""
        return self._forward(ModelInputs(tokens, positions), self.cache)

    def _forward(self, inputs: ModelInputs, cache: KVCache) -> torch.Tensor:
        """Every model forward of the sampler: ``inputs`` into ``cache`` -> each row's last logits, under the
        autocast the model's ``Numerics`` gives the sampler (``sampler_autocast``: the training forward's
        under ``batch_invariant``, none otherwise)."""
        with self.numerics.sampler_autocast(self.device):
            return model_forward(self.model, inputs, cache=cache).logits

    def _decode_logits(self) -> Callable:
        """(tokens (B, 1), positions (B, 1)) -> (B, vocab) logits: the decode forward alone, compiled like the
        decode step, for beam search (models/generation/beam.py), which chooses tokens from every row's
        logits. With CUDA graphs the logits are the graph's buffer, rewritten by the next call."""
        if self._decode_logits_forward is None:
            self._decode_logits_forward = self._compiled(self._decode_forward)
        return self._decode_logits_forward

    def _rule(self, params: SamplingParams) -> Callable:
        """(logits (B, vocab), uniforms (B,)) -> (next tokens (B,), log-probs (B,)) by ``params``' rule."""
        cut, draw = self.numerics.sampling_kernels(self.device)
        return functools.partial(sample_next, params=params, cut=cut, draw=draw,
                                 token_logprobs=self.numerics.token_logprobs(), never=self._never)

    def _decode_step(self, params: SamplingParams) -> Callable:
        """(tokens (B, 1), positions (B, 1), uniforms (B,)) -> (next tokens (B,), log-probs (B,))."""
        key = _rule_key(params)
        if key in self._decode_steps:
            return self._decode_steps[key]
        # Only the model's decode forward is compiled (and replayed as a CUDA graph): the sampling
        # rule's exact int64 prefix sums over the vocabulary are Triton kernels of their own (or
        # torch; torch 2.11's Inductor failed to generate code for them), captured as a graph of
        # their own.
        decode_logits = self._compiled(self._decode_forward)
        rule = self._rule(key)
        if self.cuda_graphs:  # the rule's kernels and small reductions, one launch
            rule = CapturedGraph(rule)

        def step(tokens: torch.Tensor, positions: torch.Tensor, uniforms: torch.Tensor):
            return rule(decode_logits(tokens, positions), uniforms)

        self._decode_steps[key] = step
        return step


def eager_graphs(model: GenerationModel) -> bool:
    """Whether the Sampler replays ``model``'s uncompiled forwards as CUDA graphs by default: under
    ``Numerics.batch_invariant`` (which compiles nothing), for a model whose parallel plan declares
    no experts. A mixture's batch-invariant expert loop (models/qwen3_moe/moe.py) splits its tokens
    by counts it reads on the host, which a captured graph would replay as they were at the capture."""
    plan = getattr(model, "parallel_plan", None)
    return model.numerics.batch_invariant and not (plan is not None and plan.has_experts)


def _rule_key(params: SamplingParams) -> SamplingParams:
    """What a decode step computes with: steps are kept by it, so max_new_tokens or stop tokens never
    recompile one."""
    return SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a device tensor on the host; on CUDA still in flight (page-locked) until the stream gets there."""
    if tensor.device.type != "cuda":
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _fetch(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """(a host copy of ``tensor`` as it is now, wait): ``wait()`` returns once the copy has landed,
    while the work queued after it may still run."""
    host = _to_host(tensor)
    if tensor.device.type != "cuda":
        return host, lambda: None
    landed = torch.cuda.Event()
    landed.record()
    return host, landed.synchronize


def _on(item: object, device: torch.device) -> object:
    """A media item on ``device`` (a tensor moved, anything else as it is)."""
    return item.to(device) if isinstance(item, torch.Tensor) else item


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _collect(
    tokens: list[list[int]], logprobs: list[list[float]], budgets: list[int], stop_token_ids: tuple[int, ...]
) -> list[Sample]:
    stops = set(stop_token_ids)
    samples = []
    for row_tokens, row_logprobs, budget in zip(tokens, logprobs, budgets):
        end = next((i + 1 for i, t in enumerate(row_tokens[:budget]) if t in stops), None)
        reason: FinishReason = "stop" if end is not None else "length"
        end = budget if end is None else end
        samples.append(Sample(tokens=row_tokens[:end], logprobs=row_logprobs[:end], finish_reason=reason))
    return samples
