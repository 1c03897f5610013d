"""The install check the README names (`pytest tests/sanity`): `import reinforge` gives its version, the one
pyproject.toml sets, and every public entry point; the committed reference config is the generated one."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_reinforge_gives_pyprojects_version_without_loading_torch():
    code = "import sys, reinforge; print(reinforge.__version__); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    version, torch_loaded = out.stdout.split()
    assert version == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert torch_loaded == "False"  # the entry points load on first use


def test_every_public_entry_point_resolves():
    import reinforge

    for name in reinforge.__all__:
        assert getattr(reinforge, name) is not None, name
    cfg = reinforge.load_config(str(ROOT / "configs" / "arith_grpo.yaml"), ["trainer.iterations=3"])
    assert cfg.trainer.iterations == 3 and callable(reinforge.train_flow)


def test_the_committed_reference_config_is_the_generated_one():
    from components.reference import reference_config

    committed = (ROOT / "configs" / "reference.yaml").read_text()
    assert committed == reference_config(), (
        "configs/reference.yaml is out of date: run `reinforge config generate --out configs/reference.yaml`"
    )


def test_config_show_names_where_each_value_came_from():
    from components.reference import resolved_config

    rows = {
        k: (v, s)
        for k, v, s in resolved_config(str(ROOT / "configs" / "arith_grpo.yaml"), ["trainer.iterations=5"])
    }
    assert rows["trainer.iterations"] == (5, "override")
    assert rows["algorithm.clip_epsilon"] == (0.2, "file")
    assert rows["algorithm.adv_estimator"] == ("grpo", "preset")  # unset in the file: the grpo preset's
    assert rows["trainer.async_mode"] == ("sync", "default")
