"""A reward model's checkpoint exports as a Hugging Face sequence classifier that transformers'
``AutoModelForSequenceClassification`` loads with Lockstep's scores (fp32, within 1e-5), padded
batches included (transformers reads the last non-pad token, Lockstep the sequence's last token);
the same directory imports back: ``model.init_from`` takes its trunk and the reward model its
score head, with the same scores.

As a reward (training/objectives/model_reward.py), the run and its export score alike and have one
identity; a reward model changed on disk has another (a resume refuses it, exit 4, naming both
hashes); one whose vocabulary or tokenizer differs from the policy's is refused (exit 2, naming both)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from core import config as config_lib
from core.exceptions import CheckpointError, ConfigError, ExitCode
from core.layout import RunPaths
from models.hf_weights import load_pretrained
from tests import launch
from training.checkpoint.load import checkpoint_dir, load_checkpoint_model
from training.checkpoint.state import check_frozen
from training.objectives.base import ObjectiveContext
from training.objectives.model_reward import ScoreShape, build_model_reward
from training.objectives.reward_model import RewardModelObjective, sequence_scores
from training.objectives.reward_model_io import SCORE_PART, read_checkpoint_score, read_score_weight

pytestmark = pytest.mark.slow

RM_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-rm.yaml"
LENGTHS = (40, 23, 31)


def _ours(model, head, ids: torch.Tensor, lengths) -> torch.Tensor:
    """Each row's first ``lengths[r]`` tokens scored alone (one document per row)."""
    out = []
    with torch.no_grad():
        for row, n in zip(ids, lengths):
            out.append(sequence_scores(model, head, row[None, :n], torch.arange(n)[None],
                                       torch.zeros(1, n, dtype=torch.long), torch.tensor([0]), torch.tensor([n - 1])))
    return torch.cat(out)


@pytest.fixture(scope="module")
def exported(e2e_workdir, tmp_path_factory):
    """A 4-step reward-model run on one rank, and its export."""
    # Evaluated at its last step on 2 batches of held-out pairs: what the score command must reproduce.
    result = launch.train(e2e_workdir, ["--config", str(RM_CONFIG), "run.name=rm-export", "train.max_steps=4",
                                        "train.eval_interval=4", "train.eval_batches=2"], nproc=1)
    assert result.returncode == 0, result.stderr
    run_dir = result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir
    out = tmp_path_factory.mktemp("rm") / "rm-hf"
    done = launch.run_module(e2e_workdir, ["training", "export", "--run", str(run_dir), "--to", str(out)])
    assert done.returncode == 0, done.stderr
    return run_dir, out


def test_export_loads_in_transformers_with_equal_scores_and_imports_back(exported):
    transformers = pytest.importorskip("transformers")
    run_dir, out = exported
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["architectures"] == ["Qwen3ForSequenceClassification"] and hf_config["num_labels"] == 1
    pad = hf_config["pad_token_id"]

    paths = RunPaths(run_dir)
    config = config_lib.load(paths.config)
    checkpoint = checkpoint_dir(paths, None)
    trunk = load_checkpoint_model(config, checkpoint).eval()
    head = torch.nn.Linear(config.model.hidden_size, 1, bias=False)
    head.weight.data.copy_(read_checkpoint_score(checkpoint))
    ids = torch.randint(0, 256, (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(1))
    ours = _ours(trunk, head, ids, LENGTHS)

    theirs_model = transformers.AutoModelForSequenceClassification.from_pretrained(str(out), dtype=torch.float32).eval()
    padded = ids.clone()
    for row, n in enumerate(LENGTHS):
        padded[row, n:] = pad  # right padding: transformers reads the last non-pad token
    mask = (padded != pad).long()
    with torch.no_grad():
        theirs = theirs_model(input_ids=padded, attention_mask=mask).logits[:, 0]
    assert (ours - theirs).abs().max().item() < 1e-5
    assert len(set(ours.tolist())) == len(LENGTHS)

    # Import: the trunk through model.init_from's loader, the head through the reward model's parts.
    imported = load_pretrained(out, base=config.model).eval()
    assert torch.equal(read_score_weight(out, config.model.hidden_size), head.weight)
    again = config_lib.load(str(RM_CONFIG), [f"model.init_from={out}"])
    context = ObjectiveContext(config=again, dist=SimpleNamespace(), parallel=SimpleNamespace(), place=lambda t: t)
    parts = RewardModelObjective(again).extra_parts(context)
    assert torch.equal(parts[SCORE_PART].module.weight, head.weight)
    assert (_ours(imported, parts[SCORE_PART].module, ids, LENGTHS) - ours).abs().max().item() < 1e-6


def _dist():
    return SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=torch.device("cpu"), backend="gloo")


def test_as_a_reward_the_run_and_its_export_score_alike_with_one_identity(exported):
    run_dir, out = exported
    config = config_lib.load(str(RM_CONFIG))
    key = "objective.grpo.rewards[0].path"
    from_run = build_model_reward(config, f"run:{run_dir}", dist=_dist(), key=key)
    from_export = build_model_reward(config, str(out), dist=_dist(), key=key)
    sequences = [list(range(3, 3 + n)) for n in LENGTHS]
    shape = ScoreShape(rows=4, width=128)  # one forward: the three sequences and a dummy row
    scores = from_run.scores(sequences, shape=shape, device=torch.device("cpu"), pad_id=257)
    assert scores == pytest.approx(from_export.scores(sequences, shape=shape, device=torch.device("cpu"), pad_id=257),
                                   abs=1e-6)
    ids = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, :len(sequence)] = torch.tensor(sequence)
    alone = _ours(from_run.trunk.module, from_run.head, ids, LENGTHS)
    assert scores == pytest.approx(alone.tolist(), abs=1e-6)  # padding rows change nothing
    assert from_run.identity == {"path": f"run:{run_dir}", "sha256": from_run.identity["sha256"]}
    assert from_run.identity["sha256"] == from_export.identity["sha256"]  # the same weights


def test_a_reward_model_changed_on_disk_has_another_identity_and_a_resume_refuses_it(exported, tmp_path):
    from safetensors.torch import load_file, save_file

    _, out = exported
    changed = tmp_path / "changed"
    shutil.copytree(out, changed)
    tensors = load_file(str(changed / "model.safetensors"))
    tensors["score.weight"] = tensors["score.weight"] * 1.5
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    config = config_lib.load(str(RM_CONFIG))
    key = "objective.grpo.rewards[0].path"
    before = build_model_reward(config, str(changed), dist=_dist(), key=key).identity
    shutil.copyfile(out / "model.safetensors", changed / "model.safetensors")  # changed again, in place
    after = build_model_reward(config, str(changed), dist=_dist(), key=key).identity
    assert before["path"] == after["path"] and before["sha256"] != after["sha256"]
    with pytest.raises(CheckpointError) as error:
        check_frozen({"reward": after}, {"reward": before})
    assert error.value.exit_code == ExitCode.CHECKPOINT
    assert before["sha256"] in str(error.value) and after["sha256"] in str(error.value)


def test_a_reward_model_of_another_vocabulary_or_tokenizer_is_refused_naming_both(exported, tmp_path):
    _, out = exported
    key = "objective.grpo.rewards[0].path"
    bigger = config_lib.load(str(RM_CONFIG), ["model.vocab_size=1024"])
    with pytest.raises(ConfigError) as error:
        build_model_reward(bigger, str(out), dist=_dist(), key=key)
    assert error.value.exit_code == ExitCode.CONFIG
    assert "512" in str(error.value) and "1024" in str(error.value) and key in str(error.value)
    other = tmp_path / "other-tokenizer"
    shutil.copytree(out, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError) as error:
        build_model_reward(config_lib.load(str(RM_CONFIG)), str(other), dist=_dist(), key=key)
    assert str(other / "tokenizer.json") in str(error.value) and "byte" in str(error.value)


def test_a_source_without_a_score_head_is_refused(tmp_path):
    config = config_lib.load(str(RM_CONFIG))
    with pytest.raises(ConfigError) as error:
        build_model_reward(config, str(tmp_path), dist=_dist(), key="objective.grpo.rewards[0].path")
    assert "sequence-classification" in str(error.value)


# ---------------------------------------------------------------------------------------------
# One read position (training/objectives/reward_model.py): one conversation, one score, on every path.

CONVERSATION = {"prompt": "What is 6 * 7?", "chosen": "42", "rejected": "41"}


def _recorded(run_dir):
    from core.run_context import load_recorded_config
    from data.chat_template import ChatTemplate
    from data.tokenizers import build_tokenizer

    config = load_recorded_config(RunPaths(run_dir))
    tokenizer = build_tokenizer(config.data.tokenizer)
    return config, tokenizer, ChatTemplate.for_tokenizer(config.data.tokenizer, config.data.chat_template)


def _packed_pair(chosen: list[int], rejected: list[int], eos: int, width: int):
    """One row holding the pair as the packer lays it (data/pipeline/packing.py ``_accept_pair``):
    each side followed by the separator, then padding."""
    from data.batch import Batch, DocSpan
    from data.fields import TARGET_MASK
    from data.preference import PAIR_ROLE

    c, r = len(chosen) + 1, len(rejected) + 1
    ids = np.full(width, eos, dtype=np.int32)
    ids[:c - 1], ids[c:c + r - 1] = chosen, rejected
    role = np.zeros(width, dtype=np.int8)
    role[:c], role[c:c + r] = 1, 2
    mask = np.zeros(width, dtype=bool)
    spans = [DocSpan("p", "f", 0, 0, c, 0), DocSpan("p", "f", 0, c, c + r, c - 1), DocSpan("<padding>", "", -1, c + r, width, 0)]
    return Batch.from_rows(1, [ids], [spans], [0], {}, {TARGET_MASK: [mask], PAIR_ROLE: [role]})


def test_one_conversation_gets_one_score_on_every_path(exported):
    """Training, held-out evaluation, a model reward in GRPO/PPO (a completion ended by its
    end-of-turn marker, by EOS, or truncated), ``python -m training score`` and the export in
    transformers on ``apply_chat_template``'s ids: one number, within 1e-5 in fp32."""
    transformers = pytest.importorskip("transformers")
    from data.preference import PreferenceEncoder
    from training.cli.score import read_pairs, reward_source, score_pairs
    from training.objectives.model_reward import ReadPosition, rollout_scores

    run_dir, out = exported
    config, tokenizer, template = _recorded(run_dir)
    checkpoint = checkpoint_dir(RunPaths(run_dir), None)
    trunk = load_checkpoint_model(config, checkpoint).eval()
    head = torch.nn.Linear(config.model.hidden_size, 1, bias=False)
    head.weight.data.copy_(read_checkpoint_score(checkpoint))
    messages = [{"role": "user", "content": CONVERSATION["prompt"]},
                {"role": "assistant", "content": CONVERSATION["chosen"]}]
    conversation = [int(t) for t in tokenizer.encode_array(template.render(messages))]
    assert template.render(messages).endswith("<|im_end|>\n")

    # 1, 2. Training and held-out evaluation: the objective's loss on the pair as the packer packs it.
    ids, _, cut = PreferenceEncoder(template, tokenizer).encode(CONVERSATION)
    assert ids[:cut].tolist() == conversation
    objective = RewardModelObjective(config)
    context = ObjectiveContext(config=config, dist=_dist(), parallel=SimpleNamespace(device=torch.device("cpu")),
                               place=lambda t: t)
    objective.setup(trunk, context)
    batch = _packed_pair(ids[:cut].tolist(), ids[cut:].tolist(), tokenizer.eos_id, width=256)
    with torch.no_grad():
        trained = objective.loss(trunk, batch, {SCORE_PART: head}).metrics["chosen_scores"].item()
        evaluated = objective.loss(trunk, batch.for_evaluation(), {SCORE_PART: head}).metrics["chosen_scores"].item()

    # 3. A model reward in GRPO and PPO: the rendered prompt + the sampled completion, as it stopped.
    reward = build_model_reward(config, f"run:{run_dir}", dist=_dist(), key="objective.grpo.rewards[1].path")
    read = ReadPosition(tokenizer, template)
    prompt = [int(t) for t in tokenizer.encode_array(template.render(messages[:1], add_generation_prompt=True))]
    content = [int(t) for t in tokenizer.encode_array(CONVERSATION["chosen"])]
    marker = [int(t) for t in tokenizer.encode_array("<|im_end|>")]
    endings = {"marker": content + marker, "eos": content + [tokenizer.eos_id], "truncated": content}
    trajectories = [SimpleNamespace(prompt_ids=prompt, tokens=tokens) for tokens in endings.values()]
    assert all(read.sequence(t.prompt_ids, t.tokens) == conversation for t in trajectories)
    rollout = rollout_scores([(1.0, reward)], read, trajectories, config=config, group_size=2,
                             device=torch.device("cpu"), pad_id=tokenizer.eos_id)

    # 4. python -m training score's code, on the record.
    pairs_file = out.parent / "one-pair.jsonl"
    pairs_file.write_text(json.dumps(CONVERSATION) + "\n")
    score_config, source = reward_source(str(run_dir), root="runs", step=None)
    pairs = read_pairs(pairs_file, PreferenceEncoder(template, tokenizer))
    (scored, _), = score_pairs(build_model_reward(score_config, source, dist=_dist(), key="--from"), pairs,
                               shape=ScoreShape(rows=8, width=128), device=torch.device("cpu"),
                               pad_id=tokenizer.eos_id)

    # 5. The export in transformers, on the ids its tokenizer's chat template gives.
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    hf_ids = hf_tokenizer.apply_chat_template(messages, tokenize=True)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert list(hf_ids) == conversation
    classifier = transformers.AutoModelForSequenceClassification.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        exported_score = classifier(input_ids=torch.tensor([conversation])).logits[0, 0].item()

    scores = {"training": trained, "evaluation": evaluated, **dict(zip(("rollout " + k for k in endings), rollout)),
              "score command": scored, "transformers": exported_score}
    assert max(scores.values()) - min(scores.values()) < 1e-5, scores
    # ... and that number is the conversation's last token's: the separator after it, or the
    # end-of-turn marker before it (where each path read until 2026-12-01), score otherwise.
    elsewhere = reward.scores([conversation + [tokenizer.eos_id], conversation[:-1]], shape=ScoreShape(rows=8, width=128),
                              device=torch.device("cpu"), pad_id=tokenizer.eos_id)
    assert all(abs(score - trained) > 1e-4 for score in elsewhere), (elsewhere, trained)


def _held_out_pairs(config, workdir, monkeypatch) -> list[dict]:
    """The preference records of the run's evaluation, in its order: its eval pipeline's first
    ``train.eval_batches`` global batches, read back from their provenance."""
    from core.objective_kinds import record_fields
    from data.pipeline import build as build_pipeline

    monkeypatch.chdir(workdir)
    pipeline = build_pipeline(config.data, seed=config.train.seed, global_batch_size=config.train.global_batch_size,
                              rank=0, world_size=1, split="eval", record_fields=record_fields(config))
    records = []
    with pipeline as batches:
        for _ in range(config.train.eval_batches):
            batch = next(batches)
            for row in batch.provenance:
                for span in row:
                    if span.record >= 0 and span.doc_offset == 0:  # a pair's chosen side opens it
                        lines = (workdir / span.shard if not Path(span.shard).is_absolute() else Path(span.shard))
                        records.append(json.loads(lines.read_text().splitlines()[span.record]))
    return records


def test_the_score_command_reproduces_the_runs_held_out_accuracy_as_grpo_reads_it(exported, e2e_workdir, tmp_path,
                                                                               monkeypatch):
    """``python -m training score`` on the run's held-out pairs prints the accuracy and margin the run's
    evaluation recorded, from the run and from its export; and scored as GRPO/PPO score a completion
    (the rendered prompt + the answer ended by the end-of-turn marker), chosen answers beat rejected
    ones exactly as often."""
    from training.objectives.model_reward import ReadPosition, rollout_scores

    run_dir, out = exported
    config, tokenizer, template = _recorded(run_dir)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    evaluation = [e for e in events if e["event"] == "eval"][-1]
    records = _held_out_pairs(config, e2e_workdir, monkeypatch)
    assert len(records) == evaluation["tokens"] == config.train.eval_batches * config.train.global_batch_size
    pairs = tmp_path / "held-out.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in records))

    for source in (run_dir, out):
        done = launch.run_module(e2e_workdir, ["training", "score", "--from", str(source), "--pairs", str(pairs), "--json"])
        assert done.returncode == 0, done.stderr
        lines = [json.loads(line) for line in done.stdout.splitlines()]
        assert [line["index"] for line in lines[:-1]] == list(range(len(records)))
        summary = lines[-1]
        assert summary["pairs"] == len(records)
        assert summary["accuracy"] == evaluation["metrics"]["accuracies"]
        assert summary["margin"] == pytest.approx(evaluation["metrics"]["margins"], abs=1e-5)
        table = launch.run_module(e2e_workdir, ["training", "score", "--from", str(source), "--pairs", str(pairs)])
        assert table.returncode == 0 and f"accuracy {summary['accuracy']:.4f}" in table.stdout

    reward = build_model_reward(config, f"run:{run_dir}", dist=_dist(), key="objective.grpo.rewards[1].path")
    read = ReadPosition(tokenizer, template)
    trajectories = []
    for record in records:
        prompt = template.render([{"role": "user", "content": record["prompt"]}], add_generation_prompt=True)
        for side in ("chosen", "rejected"):
            sampled = tokenizer.encode_array(record[side] + template.end_of_turn)  # as the sampler stops
            trajectories.append(SimpleNamespace(prompt_ids=tokenizer.encode_array(prompt), tokens=sampled))
    scores = rollout_scores([(1.0, reward)], read, trajectories, config=config, group_size=2,
                            device=torch.device("cpu"), pad_id=tokenizer.eos_id)
    assert float(np.mean(scores[0::2] > scores[1::2])) == evaluation["metrics"]["accuracies"]


def test_the_score_command_refuses_bad_input_naming_it(exported, e2e_workdir, tmp_path):
    run_dir, _ = exported
    bad = tmp_path / "bad.jsonl"
    cases = {
        "not json": ("{\"prompt\": \"a\"", "line 1 is not a JSON object", 3),
        "a field missing": (json.dumps({"prompt": "a", "chosen": "b"}), "line 1: preference record has no 'rejected'", 3),
        "empty": ("", "holds no preference pair", 3),
    }
    for name, (text, message, code) in cases.items():
        bad.write_text(text + "\n")
        done = launch.run_module(e2e_workdir, ["training", "score", "--from", str(run_dir), "--pairs", str(bad)])
        assert done.returncode == code and message in done.stderr and str(bad) in done.stderr, (name, done.stderr)
        assert "Traceback" not in done.stderr
    missing = launch.run_module(e2e_workdir, ["training", "score", "--from", str(tmp_path / "nowhere"), "--pairs",
                                              str(bad)])
    assert missing.returncode in (2, 4) and "Traceback" not in missing.stderr, missing.stderr


def test_score_from_an_export_reads_the_template_thinking_its_marker_records(exported, tmp_path):
    """``score --from EXPORT`` renders as the run did: the run's data.template_thinking, recorded in the
    export's marker where it was set, reaches the config the pairs are rendered with."""
    from training.cli.export_target import EXPORT_MARKER
    from training.cli.score import reward_source

    run_dir, out = exported
    assert "template_thinking" not in json.loads((out / EXPORT_MARKER).read_text())  # the run left it unset
    assert reward_source(str(out), root="runs", step=None)[0].data.template_thinking is None
    copy = tmp_path / "rm-thinking"
    shutil.copytree(out, copy)
    marker = json.loads((copy / EXPORT_MARKER).read_text())
    (copy / EXPORT_MARKER).write_text(json.dumps({**marker, "template_thinking": False}))
    assert reward_source(str(copy), root="runs", step=None)[0].data.template_thinking is False
