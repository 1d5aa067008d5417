"""Multi-turn episodes, token in and token out: the policy samples a turn, the environment answers
it, the answer's ids are appended, and the policy samples the next turn from the whole sequence.

**One sequence per sample.** An episode is the prompt's ids, then turn 1's sampled ids, then
the ids of the observation (the environment's tool messages rendered by the chat template's
``observation_text``: what the template writes after the turn's end-of-turn marker, up to the
next generation prompt), then turn 2's sampled ids, and so on. Sampled ids are never decoded
and encoded again (a turn is decoded only to parse its tool calls), so the ids trained on are
the ids sampled. The loss mask is 1 on sampled ids and 0 on observation ids (the prompt and
padding carry no label at all).

**Randomness.** Turn ``t`` of sample ``s`` of prompt row ``i`` is keyed
``SampleKey(seed, purpose, step, i, s)`` for ``t = 0`` (a single-turn episode draws what a plain
rollout draws) and ``(seed, f"{purpose}.turn{t}", step, i, s)`` after: each sample's draws are its
own, whichever samples share a sampler call (the sampler's rows do not interact).

**Limits** (``EpisodeLimits``): ``max_turns`` sampled turns; a turn samples at most the sampler's
``max_new_tokens`` and never beyond ``max_episode_tokens`` ids after the prompt nor past the
context (``data.seq_len``); an observation longer than ``max_observation_tokens``, or one that
leaves no room for another sampled id, or tool messages too long for the chat template to render
at all (past its size or time budget), ends the episode there (``truncated``, the observation not
appended, the reward the environment gave that turn). The last turn the runner allows (the
turn limit, or no room left) is stepped with ``last=True``: the environment must end the episode
and score it. A turn cut off without a stop (``turn.truncated``) is the environment's to judge
(the calculator environment takes it as the answer).

**One sampler call.** ``play`` hands every episode to ``Generator.play_episodes`` (the sampler's
``generate_episodes``): each episode stays in one cache row across its turns, the turns that end
at one refill point come back together (``_turn``, each at its own turn number), and an episode
that goes on continues in its row with the observation ids fed through the cache; nothing before
a turn is computed again. Which turns end together changes no id (docs/models.md).

**The environment's answers** are computed in threads (one per episode whose turn ended, reused
daemon threads: a call that never returns blocks neither the others nor the process's exit) and
applied in the order of the ended turns, whatever order they finish in. An environment whose
``reset`` or step raises, that answers with something other than a ``Transition`` or with tool
messages that do not render or tokenize (a lone surrogate), or takes longer than ``timeout_s`` is an
``EnvironmentFailure`` naming it, the step, prompt row, sample and turn (``on_error="error"``),
or ends that episode with reward 0, counted in ``env_errors`` and recorded (``"zero"``; a failed
``reset`` ends it at its first sampled turn). A
timed-out call keeps running in its thread; its answer is ignored.

**Records.** ``EpisodeResult.record()`` is a JSON-able value: per turn the sampled ids, the
observation ids, the tools called and the outcome; the reward and counts. Given the recorded
episodes of a step (``recorded``), the runner either replays them (``call_environment=False``:
each turn's sampled ids must equal the recorded ones, a ``DeterminismError`` otherwise, and the
recorded observation is appended without calling the environment) or, on a resumed step, calls
the environment and compares (a turn sampled alike but answered with other ids is a
``NondeterministicToolError`` naming the tools, the step, row, sample and turn).
"""

from __future__ import annotations

import hashlib
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
from torch import nn

from core.exceptions import DeterminismError, LockstepError
from data.chat_template import RecordError, TemplateLimitError
from models.generation.sampler import Continuation, Sample, SampleKey, SamplingParams, TurnEnd
from training.rollout.environment import EnvironmentFailure, NondeterministicToolError, Task, Transition
from training.rollout.generator import Decoder, Generator

ERROR_POLICIES = ("error", "zero")


@dataclass(frozen=True)
class EpisodeLimits:
    name: str
    """The environment's configured name (named by errors)."""
    max_turns: int
    max_observation_tokens: int
    max_episode_tokens: int
    timeout_s: float
    on_error: str
    """error: stop with EnvironmentFailure; zero: end the episode with reward 0, counted."""
    key: str = "objective.<kind>.environment"
    """The settings' config key (objective.grpo.environment), named by the errors' hints."""


@dataclass(frozen=True)
class Turn:
    sampled: tuple[int, ...]
    logprobs: tuple[float, ...]
    observation: tuple[int, ...] = ()
    calls: tuple[str, ...] = ()
    """The tools the turn called, in order ("" for a malformed call)."""
    outcome: str = "continue"
    """continue (answered, the episode goes on), done (the environment ended it), limit (an
    observation limit ended it), error or timeout (on_error=zero ended it)."""
    malformed: int = 0


@dataclass(frozen=True)
class EpisodeResult:
    turns: tuple[Turn, ...]
    reward: float
    reward_errors: int = 0
    env_errors: int = 0
    truncated: bool = False
    """A turn ran out of tokens without a stop, or a limit ended the episode."""
    text: str = ""
    """The last turn's text (what the final answer is read from)."""

    @property
    def tokens(self) -> list[int]:
        """Every id after the prompt: sampled and observation ids, in order."""
        return [t for turn in self.turns for t in (*turn.sampled, *turn.observation)]

    @property
    def mask(self) -> list[int]:
        """1 on each sampled id of ``tokens``, 0 on each observation id."""
        return [m for turn in self.turns for m in ([1] * len(turn.sampled) + [0] * len(turn.observation))]

    @property
    def logprobs(self) -> list[float]:
        """The sampler's log-prob of each sampled id, 0.0 on observation ids."""
        return [p for turn in self.turns for p in (*turn.logprobs, *[0.0] * len(turn.observation))]

    @property
    def digest(self) -> str:
        """sha256 over every turn's sampled ids and observation ids (each list prefixed by its
        length, int64 little-endian) and the mask (uint8)."""
        h = hashlib.sha256(np.asarray([len(self.turns)], dtype="<i8").tobytes())
        for turn in self.turns:
            h.update(np.asarray([len(turn.sampled), len(turn.observation)], dtype="<i8").tobytes())
            h.update(np.asarray(turn.sampled, dtype="<i8").tobytes())
            h.update(np.asarray(turn.observation, dtype="<i8").tobytes())
        h.update(np.asarray(self.mask, dtype=np.uint8).tobytes())
        return h.hexdigest()

    def record(self) -> dict[str, Any]:
        return {"turns": [{"sampled": list(t.sampled), "observation": list(t.observation), "calls": list(t.calls),
                           "outcome": t.outcome, "malformed": t.malformed} for t in self.turns],
                "reward": self.reward, "reward_errors": self.reward_errors, "env_errors": self.env_errors,
                "truncated": self.truncated}


@dataclass
class _Playing:
    """One episode while it is played."""

    task: Task
    index: int
    """The prompt index its keys use (a global prompt row, a held-out prompt's index)."""
    sample: int
    where: str
    episode: Any
    ids: list[int]
    turns: list[Turn] = field(default_factory=list)
    used: int = 0
    """Ids appended after the prompt so far."""
    result: Optional[EpisodeResult] = None
    recorded: Optional[dict] = None


class EpisodeRunner:
    """Plays episodes of ``environment`` with ``generator`` (module docstring). ``render(messages)``
    -> observation ids (the chat template's ``observation_text``, tokenized); ``context`` bounds an
    episode's whole sequence (data.seq_len)."""

    def __init__(self, *, generator: Generator, decoder: Decoder, environment, limits: EpisodeLimits,
                 render: Callable[[list[dict]], list[int]], context: int) -> None:
        self.generator, self.decoder, self.environment, self.limits = generator, decoder, environment, limits
        self.render, self.context = render, context

    def play(self, model: nn.Module, tasks: Sequence[Task], indices: Sequence[int], params: SamplingParams, *,
             purpose: str, step: int, samples: int, where: Callable[[Task, int], str],
             recorded: Optional[dict[tuple[int, int], dict]] = None, call_environment: bool = True,
             timings: Optional[dict] = None, on_ended: Optional[Callable[[int], None]] = None) -> list[EpisodeResult]:
        """``samples`` episodes of each task (task-major); task ``p``'s keys use ``indices[p]``.
        ``recorded[(indices[p], s)]``: the recorded episode (module docstring, Records). ``on_ended(n)``:
        ``n`` more episodes have ended (called at a refill point whose turns ended some: progress)."""
        recorded = recorded or {}
        playing = []
        for task, index in zip(tasks, indices):
            for s in range(samples):
                p = _Playing(task, index, s, where(task, s), None, list(task.prompt_ids), recorded=recorded.get((index, s)))
                if call_environment:
                    p.episode = self._reset(p, step)
                playing.append(p)
        def key_of(episode: int, turn: int) -> SampleKey:
            p = playing[episode]
            return SampleKey(self.generator.seed, purpose if turn == 0 else f"{purpose}.turn{turn}", step, p.index,
                             p.sample)

        host = [0.0]

        def on_turns(ended: list[TurnEnd]) -> list[Optional[Continuation]]:
            started = time.perf_counter()
            active = [playing[end.episode] for end in ended]
            self._turn(active, [end.sample for end in ended], step, call_environment, timings)
            if on_ended is not None:
                over = sum(p.result is not None or len(p.turns) >= self.limits.max_turns for p in active)
                if over:
                    on_ended(over)
            host[0] += time.perf_counter() - started
            return [None if p.result is not None or len(p.turns) >= self.limits.max_turns
                    else Continuation(p.ids, max(1, self._budget(p))) for p in active]

        was_training = model.training
        model.eval()
        try:
            self.generator.load(model)
            started = time.perf_counter()
            self.generator.play_episodes([p.ids for p in playing], key_of, params, on_turns,
                                         [max(1, self._budget(p)) for p in playing])
            if timings is not None:  # the sampler's seconds: the environment's and the host's left out
                timings["rollout_s"] += time.perf_counter() - started - host[0]
        finally:
            model.train(was_training)
        return [p.result for p in playing]

    # ------------------------------------------------------------------ one turn

    def _reset(self, p: _Playing, step: int):
        """The environment's episode for ``p``. A ``reset`` that raises is a failure of turn 0, as a
        step's is (``_failure``): an EnvironmentFailure naming it, or (on_error=zero) an episode
        whose first turn is sampled and then ends it with reward 0, counted and recorded."""
        try:
            return self.environment.reset(p.task, where=p.where)
        except LockstepError:
            raise  # the environment's own typed errors, as from its steps
        except Exception as exc:  # user code may raise anything
            return _ResetFailed(self._failure("error", f"reset() raised {type(exc).__name__}: {exc}", p, 0, step,
                                              cause=exc))

    def _budget(self, p: _Playing) -> int:
        return min(self.limits.max_episode_tokens - p.used, self.context - len(p.ids))

    def _turn(self, active: list[_Playing], drawn: list[Sample], step: int, call_environment: bool,
              timings: Optional[dict]) -> None:
        """The ended turns of ``active`` (each at its own turn number): answered, applied, compared."""
        completions, lasts, turns = [], [], [len(p.turns) for p in active]
        for p, sample, turn in zip(active, drawn, turns):
            budget = self._budget(p)
            if len(sample.tokens) > budget:
                sample = Sample(tokens=sample.tokens[:budget], logprobs=sample.logprobs[:budget], finish_reason="length")
            completion = self.decoder.completion(sample)
            completions.append(completion)
            lasts.append(turn + 1 == self.limits.max_turns or budget - len(completion.sample.tokens) <= 0)
            if timings is not None:
                timings["rollout_tokens"] += len(completion.sample.tokens)
        if call_environment:
            answers = self._answers(active, completions, lasts, turns, step)
        else:
            answers = [None] * len(active)
        for p, completion, turn, answer in zip(active, completions, turns, answers):
            sampled = tuple(int(t) for t in completion.sample.tokens)
            logprobs = tuple(float(x) for x in completion.sample.logprobs[:len(sampled)])
            if not call_environment:
                self._replayed(p, sampled, logprobs, completion.text, turn, step)
                continue
            self._apply(p, sampled, logprobs, completion, answer, turn, step)
            self._compare(p, turn, step)

    def _answers(self, active: list[_Playing], completions, lasts, turns: list[int], step: int) -> list:
        """Each episode's Transition (or the failure that ended it), in the order of ``active``: every
        episode's step runs in a daemon thread of its own (``_Workers``: a call that never returns
        neither blocks the others nor the process's exit), and each is waited for at most ``timeout_s``."""
        calls = [None if isinstance(p.episode, _ResetFailed)  # its reset failed: the turn ends it
                 else _Call(lambda p=p, c=c, last=last: p.episode.step(c, last=last))
                 for p, c, last in zip(active, completions, lasts)]
        for call in calls:
            if call is not None:
                _WORKERS.submit(call)
        return [active[i].episode.outcome if call is None else self._awaited(call, active[i], turns[i], step, lasts[i])
                for i, call in enumerate(calls)]

    def _awaited(self, call: "_Call", p: _Playing, turn: int, step: int, last: bool):
        timeout = self.limits.timeout_s
        if not call.done.wait(timeout=max(0.0, call.started + timeout - time.monotonic())):
            return self._failure("timeout", f"took longer than tool_timeout_s={timeout:g} s", p, turn, step)
        if isinstance(call.error, LockstepError):
            raise call.error  # the rewards' own typed errors (objective.grpo.on_reward_error), the record's
        if call.error is not None:  # user code may raise anything: named, then stopped or counted
            return self._failure("error", f"raised {type(call.error).__name__}: {call.error}", p, turn, step,
                                 cause=call.error)
        problem = _transition_problem(call.value, last)
        if problem:
            return self._failure("error", problem, p, turn, step)
        return call.value

    def _failure(self, outcome: str, what: str, p: _Playing, turn: int, step: int, cause=None) -> str:
        if self.limits.on_error != "zero":
            raise EnvironmentFailure(
                f"environment {self.limits.name!r} {what} on {p.where}, turn {turn}",
                environment=self.limits.name, step=step, sample=p.where, turn=turn,
                hint=f"fix the environment, or set {self.limits.key}.on_env_error=zero to end such "
                     "episodes with reward 0 and count them") from cause
        return outcome

    def _apply(self, p: _Playing, sampled, logprobs, completion, answer, turn: int, step: int) -> None:
        observation: Optional[list[int]] = None
        if not isinstance(answer, str) and not answer.done:
            observed = self._observation(answer, p, turn, step)
            if isinstance(observed, str):
                answer = observed
            else:
                observation = observed
        if isinstance(answer, str):  # on_error=zero: the failure ends the episode
            p.turns.append(Turn(sampled, logprobs, outcome=answer))
            p.result = self._result(p, reward=0.0, env_errors=1, truncated=completion.truncated, text=completion.text)
            return
        p.used += len(sampled)
        p.ids += sampled
        if answer.done:
            p.turns.append(Turn(sampled, logprobs, calls=answer.calls, outcome="done", malformed=answer.malformed))
            p.result = self._result(p, reward=float(answer.reward), reward_errors=answer.reward_errors,
                                    truncated=completion.truncated, text=completion.text)
            return
        if (observation is None or len(observation) > self.limits.max_observation_tokens
                or p.used + len(observation) >= self.limits.max_episode_tokens
                or len(p.ids) + len(observation) >= self.context):
            p.turns.append(Turn(sampled, logprobs, calls=answer.calls, outcome="limit", malformed=answer.malformed))
            p.result = self._result(p, reward=float(answer.reward), reward_errors=answer.reward_errors, truncated=True,
                                    text=completion.text)
            return
        p.turns.append(Turn(sampled, logprobs, tuple(int(t) for t in observation), answer.calls, "continue",
                            answer.malformed))
        p.used += len(observation)
        p.ids += observation

    def _observation(self, answer: Transition, p: _Playing, turn: int, step: int):
        """The ids of ``answer``'s observation; None where its tool messages are too long for the chat
        template to render (over its size or time budget: an observation far over any
        max_observation_tokens, which ends the episode as a longer one does); a failure
        (``_failure``) where they do not render or tokenize (a lone surrogate, a template refusing
        them): the environment answered with text no model can read."""
        if answer.observation:
            return list(answer.observation)
        try:
            return self.render(list(answer.messages))
        except TemplateLimitError:
            return None
        except RecordError as exc:  # the template's or the tokenizer's refusal of this text
            return self._failure("error", f"answered with tool messages that do not render: {exc.message}", p, turn,
                                 step, cause=exc)
        except LockstepError:
            raise
        except Exception as exc:
            return self._failure("error", f"answered with tool messages that do not render: {type(exc).__name__}: "
                                 f"{exc}", p, turn, step, cause=exc)

    def _result(self, p: _Playing, *, reward: float, truncated: bool, text: str, reward_errors: int = 0,
                env_errors: int = 0) -> EpisodeResult:
        return EpisodeResult(tuple(p.turns), reward, reward_errors=reward_errors, env_errors=env_errors,
                             truncated=truncated, text=text)

    def _compare(self, p: _Playing, turn: int, step: int) -> None:
        """A resumed step: this turn against the recorded one (module docstring, Records)."""
        if p.recorded is None or turn >= len(p.recorded["turns"]):
            return
        was, now = p.recorded["turns"][turn], p.turns[turn]
        if was["sampled"] != list(now.sampled):
            p.recorded = None  # the policy sampled otherwise (new weights): nothing to compare further
            return
        if was["observation"] != list(now.observation) or was["outcome"] != now.outcome:
            tools = ", ".join(repr(name) for name in was["calls"] if name) or "(no tool)"
            raise NondeterministicToolError(
                f"environment {self.limits.name!r} answered turn {turn} of {p.where} with other observation ids "
                f"than the recorded run (outcome {was['outcome']} -> {now.outcome}); tools called: {tools}",
                environment=self.limits.name, tool=tools, step=step, sample=p.where, turn=turn,
                hint="a tool must answer the same call with the same text (no clock, randomness or outside state); "
                     "fix it, then resume from a checkpoint before this step")

    def _replayed(self, p: _Playing, sampled, logprobs, text: str, turn: int, step: int) -> None:
        """Replay: the recorded turn's observation, without calling the environment."""
        if p.recorded is None:
            raise DeterminismError(f"no recorded episode for {p.where}", step=step, sample=p.where,
                                   hint="the run's episodes/ record of this step is missing or incomplete")
        turns = p.recorded["turns"]
        if turn >= len(turns) or turns[turn]["sampled"] != list(sampled):
            raise DeterminismError(f"turn {turn} of {p.where} sampled other ids than the recorded episode",
                                   field="episodes_hash", step=step, sample=p.where, turn=turn,
                                   hint="the step is not reproduced; compare the run's meta.json environment with this one")
        was = turns[turn]
        observation = tuple(int(t) for t in was["observation"])
        p.turns.append(Turn(sampled, logprobs, observation, tuple(was["calls"]), was["outcome"], was["malformed"]))
        p.used += len(sampled) + len(observation)
        p.ids += [*sampled, *observation]
        if turn + 1 == len(turns):
            p.result = EpisodeResult(tuple(p.turns), float(p.recorded["reward"]), p.recorded["reward_errors"],
                                     p.recorded["env_errors"], p.recorded["truncated"], text)


@dataclass(frozen=True)
class _ResetFailed:
    """An episode whose ``reset`` raised under on_error=zero: its first turn ends it with ``outcome``."""

    outcome: str


class _Workers:
    """Daemon threads that run ``_Call``s, each call at once: a call taken by an idle thread, or by a
    new one when none is idle. A thread goes back to waiting for calls once its call returns, so
    calls cost no thread start (a start waits until the new thread runs: about a quarter of a
    millisecond, for every episode of every turn); a call that never returns holds its thread and
    nothing else."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.idle = 0
        self.started = 0

    def submit(self, call: "_Call") -> None:
        with self.lock:
            spawn = self.idle == 0
            if not spawn:
                self.idle -= 1  # this idle thread's next call is this one (or one as early)
            else:
                self.started += 1
        if spawn:
            threading.Thread(target=self._serve, name=f"environment-{self.started}", daemon=True).start()
        self.calls.put(call)

    def _serve(self) -> None:
        while True:
            self.calls.get().run()
            with self.lock:
                self.idle += 1


_WORKERS = _Workers()


class _Call:
    """One environment step run in a thread: when it started, and its value or error once done."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.started = fn, time.monotonic()
        self.done = threading.Event()
        self.value: Any = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        self.started = time.monotonic()
        try:
            self.value = self.fn()
        except BaseException as exc:  # handed to the waiting thread, which names it
            self.error = exc
        finally:
            self.done.set()


def _transition_problem(answer: Any, last: bool) -> str:
    """Why ``answer`` is not a usable Transition ("" when it is)."""
    if not isinstance(answer, Transition):
        return f"returned {type(answer).__name__}, not a Transition"
    if isinstance(answer.reward, bool) or not isinstance(answer.reward, (int, float)) or not math.isfinite(answer.reward):
        return f"returned the reward {answer.reward!r}, not a finite number"
    if not isinstance(answer.done, bool):
        return f"returned done={answer.done!r}, not a bool"
    if last and not answer.done:
        return "continued an episode at its last allowed turn (last=True must end it)"
    if not answer.done:
        if not answer.observation and not answer.messages:
            return "continued the episode with neither messages nor observation ids"
        for message in answer.messages:
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                return f"returned the message {message!r}, not {{'role': str, 'content': str}}"
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in answer.observation):
            return "returned observation ids that are not all integers"
    return ""
