"""Every file in configs/ keeps its config hash, and with it the IDs of the runs made from it.

A new config key must not change the hash of configs that leave it at its default (list it in
core.config.HASHED_ONLY_WHEN_SET); a hash here changes only when the file's settings do, on purpose.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import config_hash, load

ROOT = Path(__file__).resolve().parents[2]

# A config that needs a value given on the command line gets the same one here.
OVERRIDES = {"configs/tiny-distill.yaml": ["objective.distill.teacher=run:tiny-teacher-20260101-000000-abcd1234"]}

HASHES = {
    "configs/qwen2.5-0.5b-lora-sft.yaml": "bda8bd41be78f84da104263a08412e229bb65577f98de0478b03eba66b8c04f2",
    "configs/qwen2.5-0.5b-lora.yaml": "a18d61b201c6d80d01f352003546ab6164e44fbf213aa3cc9bc6b62b3ae2d7f5",
    "configs/qwen2.5-0.5b.yaml": "fbb0e489efb87bfc0e9b3bd2db20cf8970e7089f1140bcc1a57bbaa87975ed01",
    "configs/qwen2.5-1.5b.yaml": "b0d7f6371a8c7ed091a86a094faa89e5a81cac8de81e8a6281148ace5f32f872",
    "configs/qwen2.5-vl-3b.yaml": "ed1b3a27429a8cb4c18d8740836004c9286fafd8e60751f01930b588ec9b337e",
    "configs/qwen3-0.6b-dpo.yaml": "198debc3bde0157924a9cbc8519d2a1e67f13ac7832ff5ef42597774a94afd14",
    "configs/qwen3-0.6b-grpo.yaml": "30bdd2f1c9505468ccff3be2941ce6cfbc94014ba6f5703f08714639d5d333bf",
    "configs/qwen3-0.6b-ppo.yaml": "c9dcdd3fa68d92a2deb00e48e4cc67328c79f5a64ec97f27857b3c25d57276a5",
    "configs/qwen3-0.6b-rm.yaml": "79cf8090ffec86ae2edb63c9898d6a986239185c802ea2dc2b6968d3705a2ca6",
    "configs/qwen3-0.6b-sft.yaml": "3b66341378fc758abd8e7b75abd120d4e05fcdffcd216e47123d59cb5970d430",
    "configs/qwen3-0.6b.yaml": "1f19a367d093267464aa3aef15efeb6ed55ef2a0a8fea2c6d9685ba1aad58b2c",
    "configs/qwen3-1.7b-lora.yaml": "d0a078319139fce1c2adaa97c6aeb92b86fd51a79760b67f4bdacc9b0c411362",
    "configs/qwen3-1.7b-qlora-sft.yaml": "a0eb41e270aa9dbd3a1f3f2fd3958e31d60249aca99dda1a85a50e7da465e146",
    "configs/qwen3-1.7b-qlora.yaml": "66abfce8379ac917ff28b4748ded9085e0197cd6bfbd8643fbcd0612cfb16b87",
    "configs/qwen3-1.7b.yaml": "e4fc3dccc012075a5644c5c7a80a4fbd6b2c18d7a9247581d7513c9c6ea10bb4",
    "configs/qwen3-30b-a3b.yaml": "747aaac18453ecd2652a7bfa03346083c35773124a38f4e1f49ad3bd30be0a2b",
    "configs/qwen3-8b.yaml": "ac7167fb1928cfaf5db91940390398f54d9d29afdd58adcf32cf5db21e1c98a5",
    "configs/tiny-agent-grpo.yaml": "68241d729c8e5bd12ea900326c2e24c81c446453dcef6b6b7cfb6240561f2760",
    "configs/tiny-agent-sft.yaml": "a1ef8f9c36bfe839d70f6aab71955057cf450f95991958408a79447fdb7c94bb",
    "configs/tiny-agent-sft-1.yaml": "7efdd151c4e36761241a9f08964fe2244837f78ce2ff419bd48fd960a33532ea",
    "configs/tiny-agent-sft-2.yaml": "799f9fd8235d0d0ccc8aa52371ab66c50b67e93e2fbfd3822efe875eb5a74150",
    "configs/tiny-agent-sft-3.yaml": "8f9ea9a3530320c53d8a6535fce0407cf517f3dfb284dfbc67859411e9e7cf72",
    "configs/tiny-distill.yaml": "81e2bc7a157160c6ad3cab41dc5797e6baf4d9958e175f8fa57fd45ef458d829",
    "configs/tiny-dpo.yaml": "cefa4af44e5f9ab346aff74333538845cf4ece72dd73768820a8fa8750d79c03",
    "configs/tiny-grpo.yaml": "225be4092f693e2fe238d7ebe1bde3d7ba4b3c343d8cecf0c13cc918d039c06e",
    "configs/tiny-lora.yaml": "3491e5be25d5a872a23f7490af0a5c063a9864bae86b988905e875f47021b68f",
    "configs/tiny-moe.yaml": "f2138495c8e5c0d3b10a8cc437893c54ac8e83a32f1b060fe6e5514e68e7bd0b",
    "configs/tiny-moe-grpo.yaml": "99f5172524bf27c80a8d7f62b811dbe67c45ceb56a87aca33e63af2c369929a1",
    "configs/tiny-moe-sft.yaml": "1d9a53ffebf1569f72fbccfea222bb83aab9ac67b8a4169a611020d85e203739",
    "configs/tiny-ppo.yaml": "7791584f3436b7ddd948dd191e1dc7e30094c1e9bc7f7a5bea4f80db8f90cf7e",
    "configs/tiny-rm.yaml": "5f04f3f3469c411a920cd4639e1175a3e7e9c893b2c3808b3a48d7954e0e1c2a",
    "configs/tiny-qlora.yaml": "d5f0c5b2d64f2822769dcdd67e21e17617f90a5ba608ff62a427d591791ac9ab",
    "configs/tiny-sft.yaml": "9304890728027893d584835de6c554c1560b2ddef21134fcfb37e9c234d3df92",
    "configs/tiny-vl-grpo.yaml": "41f65a363a762ce51ed580683fa0c96474a6f1178379d8baf658437af5b5d908",
    "configs/tiny-vl-shapes-grpo.yaml": "ab00bcff036f30b4c6068751d2f19d451e1fed98abcb1ad09a1fb406a43f7f6e",
    "configs/tiny-vl-shapes-sft.yaml": "aa3f1c9e0635b2793bfe3d339623e9c9049a0f56bd13cce9b3f44376f7444a2b",
    "configs/tiny-vl-shapes-sft-short.yaml": "39bc5641062ad20407ab829e82856f34f003c15ea09fa8db94732627f43e9c5c",
    "configs/tiny-vl-sft.yaml": "dc9a76b7ad86c3a27fd080e84f2d6379fa29c946aa3ef4544ec6f0143e979702",
    "configs/tiny.yaml": "ad92bf007bfd1592991d2307afe0be346f3acf5c227e59b3365208012f704754",
}


def test_every_config_file_is_listed():
    assert sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml")) == sorted(HASHES)


@pytest.mark.parametrize("name", sorted(HASHES))
def test_config_file_keeps_its_hash(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert config_hash(load(name, OVERRIDES.get(name, []))) == HASHES[name]
