"""model.arch's names come from registered model-family rows (core/model_families.py), and a family
registered through LOCKSTEP_REGISTER (core/registration.py) needs no edit of Lockstep: unknown names
are refused listing the registered ones, a family's own section is hashed only once set, and the
Qwen rows carry the defaults the model reads."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from core import config as config_lib
from core import model_families
from core.exceptions import ConfigError
from core.model_families import model_family, register_family
from models.qwen.family import QWEN2

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


@dataclass(frozen=True)
class ToySettings:
    experts: int = 4
    """Experts per block."""


TOY = replace(QWEN2, name="toy", summary="a test family with a section", settings=ToySettings)


@pytest.fixture
def toy_family():
    register_family(TOY)
    yield TOY
    model_families.unregister_family(TOY.name)


def test_an_unknown_arch_lists_the_registered_names_and_the_nearest():
    with pytest.raises(ConfigError) as error:
        config_lib.load(TINY, ["model.arch=qwen4"])
    listed = " | ".join(repr(family.name) for family in model_families.model_families())
    assert listed.startswith("'qwen2' | 'qwen3'")  # the built-in rows first, in the order of registration
    assert error.value.message == f"model.arch must be one of {listed}, got 'qwen4'"
    assert error.value.hint == "did you mean 'qwen2'?" or error.value.hint == "did you mean 'qwen3'?"
    assert error.value.context["key"] == "model.arch"


def test_the_qwen_rows_declare_the_defaults_the_model_reads():
    from models.qwen.dims import resolve_dims

    qwen2, qwen3 = (resolve_dims(config_lib.ModelConfig(arch=arch)) for arch in ("qwen2", "qwen3"))
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen3.qkv_bias, qwen3.qk_norm) == (True, False, False, True)
    assert model_family("qwen3").hf_architectures == ("Qwen3ForCausalLM",)


def test_a_family_section_is_hashed_only_once_set(toy_family):
    plain = config_lib.load(TINY)
    assert plain.model.toy == ToySettings()
    assert plain.hash == config_lib.load(TINY, ["model.arch=qwen3"]).hash  # the default section: no change
    toy = config_lib.load(TINY, ["model.arch=toy", "model.toy.experts=8"])
    assert toy.model.toy.experts == 8 and toy.hash != plain.hash
    assert pickle.loads(pickle.dumps(toy)) == toy
    assert ("model.toy.experts", "int", "4", "Experts per block.") in config_lib.describe()


def test_a_family_registered_twice_differently_is_refused(toy_family):
    with pytest.raises(ConfigError, match="registered twice"):
        register_family(replace(TOY, summary="another"))


def test_a_family_registers_through_the_environment_variable(tmp_path):
    """A user's module named in LOCKSTEP_REGISTER registers its family before the config is read,
    without torch (the launcher's check)."""
    (tmp_path / "user_family.py").write_text(textwrap.dedent("""
        import dataclasses
        from core.model_families import register_family
        from models.qwen.family import QWEN3

        def register():
            register_family(dataclasses.replace(QWEN3, name="userfam", summary="a user's family"))
    """))
    probe = ("import sys\n"
             "from core.config import load\n"
             f"config = load({str(TINY)!r}, ['model.arch=userfam'])\n"
             "print(config.model.arch, 'torch' in sys.modules)\n")
    env = {"PYTHONPATH": f"{ROOT}:{tmp_path}", "LOCKSTEP_REGISTER": "user_family:register", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["userfam", "False"], (result.stdout, result.stderr)
    env["LOCKSTEP_REGISTER"] = "user_family:nothing_here"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0 and "has no attribute 'nothing_here'" in result.stderr
