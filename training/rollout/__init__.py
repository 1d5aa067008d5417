"""The rollout room: generation for training, and what comes back from it.

- ``generator.py``: the ``Generator`` (weights handed to the sampler, keyed per-sample
  randomness, prompts -> completions) and the ``Decoder`` (stop tokens, end-of-turn cut);
  GRPO, the held-out evaluations and ``python -m training generate`` all sample through it.
- ``environment.py``: the ``Environment`` interface (``reset(task) -> episode``,
  ``episode.step(turn) -> reward, done, observation``) and today's single-turn
  ``RewardEnvironment`` built from the reward functions (``rewards.py``).
- ``group.py``: ``GroupRollout``, ``group_size`` completions per prompt through an environment,
  with DAPO's overlong shaping and dynamic sampling.
- ``experience.py``: the ``Experience`` a rollout returns, an explicit value (trajectories,
  rewards, advantages, counts, timings), and its layout as a training batch.
- ``advantages.py``: shaped rewards -> group-normalized advantages.
- ``reward_settings.py``: ``RewardSettings``, one entry of GRPO's and PPO's ``rewards``, and its checks.
- ``environment_settings.py``, ``tool_environment.py``, ``tool_calls.py``, ``episodes.py``,
  ``episode_store.py``: multi-turn episodes with tools (their settings, the tool environments, the
  ``EpisodeRunner``, each step's recorded episodes); ``agent.py`` builds them from a method's
  ``environment`` settings, for GRPO and PPO alike.
- ``evaluation.py``: the held-out evaluation GRPO and PPO share (keyed decoding, reward and
  exact-answer scores, the loss and metric sums).

The room imports no other part of ``training`` (tests/test_layering.py): objectives use it, it
uses none of them.
"""
