"""Model directories are data, not code (issue 37, class 1 and the model-directory cases of class 9).

A directory that asks transformers to import its own Python (`auto_map` in any of its config files) is refused,
naming actor.model.trust_remote_code, on every load path, and nothing is ever read from stdin: the code it
carries would write a canary file, which must never appear. A directory of an architecture transformers does not
know, a config that disagrees with its weights (an absurd vocabulary, more or fewer layers), safetensors headers
that lie, and a pickle under a safetensors name are each one ConfigError naming the file or key, before anything
is allocated or unpickled. With the key set, the directory's code does run: the opt-in is real."""

from __future__ import annotations

import io
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from components.errors import ConfigError
from components.models.loading import check_model_dir, load_model, load_tokenizer
from tests.conftest import refused_in_one_line

CONFIG_PY = """
from pathlib import Path
from transformers import Qwen2Config
Path({canary!r}).write_text("ran")
class EvilConfig(Qwen2Config):
    model_type = "evil_qwen"
"""
MODELING_PY = """
from transformers import Qwen2ForCausalLM
from .configuration_evil import EvilConfig
class EvilModel(Qwen2ForCausalLM):
    config_class = EvilConfig
"""


def code_dir(tiny_model_dir: Path, tmp_path: Path, where: str = "config.json") -> tuple[Path, Path]:
    """A copy of the tiny model whose `where` asks to run code that writes a canary; (directory, canary)."""
    d, canary = tmp_path / "evil", tmp_path / "canary"
    shutil.copytree(tiny_model_dir, d)
    (d / "configuration_evil.py").write_text(CONFIG_PY.format(canary=str(canary)))
    (d / "modeling_evil.py").write_text(MODELING_PY)
    auto_map = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilModel",
        "AutoTokenizer": ["configuration_evil.EvilConfig", None],
    }
    config = json.loads((d / where).read_text())
    config["auto_map"] = auto_map
    if where == "config.json":
        config["model_type"] = "evil_qwen"
    (d / where).write_text(json.dumps(config))
    return d, canary


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_a_directory_that_asks_to_run_code_is_refused_on_every_load_path(
    tiny_model_dir, tmp_path, where, monkeypatch
):
    d, canary = code_dir(tiny_model_dir, tmp_path, where)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\ny\ny\n"))  # a prompt answered yes would run it
    for load in (
        lambda: check_model_dir(d, "actor.model.path"),
        lambda: load_tokenizer(d),
        lambda: load_model(d),
    ):
        with pytest.raises(ConfigError, match="actor.model.trust_remote_code=true") as exc:
            load()
        assert f"{where} auto_map" in str(exc.value) and "\n" not in str(exc.value)
    assert not canary.exists()


def test_the_reward_model_critic_engine_and_processor_paths_refuse_it_too(tiny_model_dir, tmp_path):
    from components.models.vlm import load_processor
    from components.rewards.reward_model import load_reward_model
    from components.rollout.worker import RolloutWorker
    from components.settings import LoraSettings
    from components.training.critic import build_value_model

    d, canary = code_dir(tiny_model_dir, tmp_path)
    for load in (
        lambda: load_reward_model(str(d)),
        lambda: build_value_model(str(d), "float32", "sdpa", "critic.model_path", LoraSettings()),
        lambda: RolloutWorker(str(d)),
        lambda: load_processor(d, None),
    ):
        with pytest.raises(ConfigError, match="trust_remote_code"):
            load()
    assert not canary.exists()


def test_the_commands_refuse_it_in_one_line_even_with_yes_on_stdin(tiny_model_dir, tmp_path):
    d, canary = code_dir(tiny_model_dir, tmp_path)
    for cmd in (
        ["generate", "--model_path", str(d), "1+1="],
        ["convert", "--to", "sharded", "--source", str(d), "--out", str(tmp_path / "out")],
    ):
        res = subprocess.run(
            [sys.executable, "-m", "flows.cli", *cmd],
            input="y\n" * 5,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 2, res.stderr[-2000:]
        assert res.stderr.strip().startswith("error: ") and len(res.stderr.strip().splitlines()) == 1, (
            res.stderr
        )
        assert "auto_map" in res.stderr and "Traceback" not in res.stderr
    assert not canary.exists()


def test_with_the_key_set_the_directorys_code_does_run(tiny_model_dir, tmp_path):
    d, canary = code_dir(tiny_model_dir, tmp_path)
    model = load_model(d, trust_remote_code=True)
    assert canary.read_text() == "ran" and type(model).__name__ == "EvilModel"


def test_an_architecture_transformers_does_not_know_is_named(tiny_model_dir, tmp_path):
    d = tmp_path / "unknown"
    shutil.copytree(tiny_model_dir, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "made_up_arch"}))
    with pytest.raises(ConfigError, match="model_type 'made_up_arch' is not an architecture transformers"):
        load_model(d)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="config.json holds a JSON list, not an object"):
        load_model(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is not readable JSON"):
        load_model(d)


def _rewrite_header(path: Path, change) -> None:
    """Rewrite a safetensors file's header through `change(header)`, keeping its data bytes."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    change(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def _first_tensor(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


@pytest.mark.parametrize(
    "lie",
    [
        ("length", lambda p: p.write_bytes(struct.pack("<Q", 2**40) + p.read_bytes()[8:])),
        ("truncated", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])),
        ("offsets", lambda p: _rewrite_header(p, lambda h: _first_tensor(h).update(data_offsets=[0, 2**40]))),
        ("dtype", lambda p: _rewrite_header(p, lambda h: _first_tensor(h).update(dtype="F128"))),
        ("shape", lambda p: _rewrite_header(p, lambda h: _first_tensor(h).update(shape=[10**6, 10**6]))),
        ("not json", lambda p: p.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{[" + p.read_bytes()[12:])),
    ],
    ids=lambda lie: lie[0],
)
def test_safetensors_headers_that_lie_are_named_before_loading(tiny_model_dir, tmp_path, lie):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    lie[1](d / "model.safetensors")
    with pytest.raises(ConfigError, match=r"model.safetensors is not a sound safetensors file"):
        load_model(d)


def test_a_pickle_under_a_safetensors_name_is_refused_and_never_unpickled(tiny_model_dir, tmp_path):
    import pickle

    class Boom:
        def __reduce__(self):
            return (Path(tmp_path / "canary").write_text, ("ran",))

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    (d / "model.safetensors").write_bytes(pickle.dumps({"w": Boom()}))
    with pytest.raises(ConfigError, match="is not a sound safetensors file"):
        load_model(d)
    assert not (tmp_path / "canary").exists()


@pytest.mark.parametrize(
    "change, said",
    [
        ({"vocab_size": 10**12}, "vocab_size 1000000000000 is not the embedding's"),
        ({"num_hidden_layers": 7}, "num_hidden_layers 7 is not the 1 layers in the weights"),
    ],
)
def test_a_config_that_disagrees_with_its_weights_is_refused_before_allocating(
    tiny_model_dir, tmp_path, change, said
):
    import time

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **change}))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=said):
        load_model(d)
    assert time.perf_counter() - start < 5  # refused from the headers, nothing allocated


def _linked(tiny_model_dir: Path, tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A copy of the tiny model with one link leading out of it; (the directory, the link's name)."""
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    if kind == "tokenizer to a foreign file":
        secret = outside / "secret.json"
        shutil.copy(d / "tokenizer.json", secret)  # a readable file: only the link's target betrays it
        (d / "tokenizer.json").unlink()
        (d / "tokenizer.json").symlink_to(secret)
        return d, "tokenizer.json"
    if kind == "weights elsewhere":
        shutil.move(d / "model.safetensors", outside / "w.safetensors")
        (d / "model.safetensors").symlink_to(outside / "w.safetensors")
        return d, "model.safetensors"
    if kind == "relative link up and out":
        shutil.move(d / "config.json", tmp_path / "config.json")
        (d / "config.json").symlink_to("../config.json")
        return d, "config.json"
    if kind == "a folder link":
        (d / "extra").symlink_to(outside, target_is_directory=True)
        return d, "extra"
    if kind == "a system file":
        (d / "chat_template.jinja").unlink(missing_ok=True)
        (d / "chat_template.jinja").symlink_to("/etc/hostname")
        return d, "chat_template.jinja"
    raise ValueError(kind)


LINKS = (
    "tokenizer to a foreign file",
    "weights elsewhere",
    "relative link up and out",
    "a folder link",
    "a system file",
)


@pytest.mark.parametrize("kind", LINKS)
def test_a_link_leading_out_of_a_model_directory_is_refused_on_every_load_path(
    tiny_model_dir, tmp_path, kind
):
    from components.rewards.reward_model import load_reward_model
    from components.rollout.worker import RolloutWorker
    from components.settings import LoraSettings
    from components.training.critic import build_value_model

    d, link = _linked(tiny_model_dir, tmp_path, kind)
    for load in (
        lambda: check_model_dir(d, "actor.model.path"),
        lambda: load_tokenizer(d),
        lambda: load_model(d),
        lambda: RolloutWorker(str(d)),
        lambda: load_reward_model(str(d)),
        lambda: build_value_model(str(d), "float32", "sdpa", "critic.model_path", LoraSettings()),
    ):
        with pytest.raises(ConfigError) as exc:
            load()
        message = str(exc.value)
        assert f"{link} is a symbolic link to" in message and "outside the model directory" in message
        assert "\n" not in message


def test_the_command_refuses_a_link_out_in_one_line(tiny_model_dir, tmp_path):
    d, _ = _linked(tiny_model_dir, tmp_path, "a system file")
    err = refused_in_one_line(["generate", "--model_path", str(d), "1+1="])
    assert "chat_template.jinja is a symbolic link to /etc/hostname" in err


def test_links_inside_the_directory_and_the_hugging_face_cache_layout_load(tiny_model_dir, tmp_path):
    inside = tmp_path / "inside"
    shutil.copytree(tiny_model_dir, inside)
    (inside / "weights").mkdir()
    shutil.move(inside / "model.safetensors", inside / "weights" / "model.safetensors")
    (inside / "model.safetensors").symlink_to("weights/model.safetensors")
    assert load_model(inside) is not None
    # models--org--name/snapshots/<revision>/<file> -> ../../blobs/<hash>, as huggingface_hub lays it out
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted(p for p in tiny_model_dir.iterdir() if p.is_file())):
        shutil.copy(f, repo / "blobs" / f"blob{i}")
        (snapshot / f.name).symlink_to(f"../../blobs/blob{i}")
    assert load_model(snapshot) is not None and load_tokenizer(snapshot) is not None
