"""On-policy distillation (distill.*, algorithm.name=opd) in the training flow: the student trained by its
teacher's scores of its own samples moves toward the teacher, the advantages are the teacher's log-probs less
the student's, and what cannot work is refused in one line."""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from components.errors import ConfigError
from components.models import build_char_tokenizer, save_pretrained
from components.validate import load_checked
from tests.conftest import make_model
from tests.flows.local import overrides, run_locally

ITERS = 4


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tokenizer):
    """The student's own model (conftest's tiny one) made sharper, its embedding (tied to the LM head) scaled
    up: a teacher whose favourite tokens the student already samples now and then, so sampled reverse KL has
    something to learn from (a random tiny model is near uniform, and so near any other)."""
    out = tmp_path_factory.mktemp("teacher")
    teacher = make_model(tokenizer)
    with torch.no_grad():
        teacher.get_input_embeddings().weight.mul_(3.0)
    save_pretrained(teacher, tokenizer, out)
    return out


def _distil(local_root, student, teacher, name, *extra):
    ov = overrides(
        local_root,
        name,
        student,
        "algorithm.name=opd",
        f"distill.teacher_path={teacher}",
        f"trainer.iterations={ITERS}",
        "actor.ppo_mini_batch_size=4",  # several steps per iteration
        *extra,
    )
    info = run_locally(ov)
    client = MlflowClient(f"sqlite:///{local_root}/mlflow.db")
    return lambda key: [
        m.value for m in sorted(client.get_metric_history(info["run_id"], key), key=lambda m: m.step)
    ]


def test_the_jsd_student_moves_toward_its_teacher(local_root, tiny_model_dir, teacher_dir):
    series = _distil(local_root, tiny_model_dir, teacher_dir, "opd_jsd", "distill.loss=jsd")
    kl = series("distill/reverse_kl")
    assert len(kl) == ITERS and kl[-1] < 0.8 * kl[0], kl
    assert len(series("distill/jsd")) == ITERS


def test_the_reverse_kl_advantages_are_the_teachers_log_probs_less_the_students(
    local_root, tiny_model_dir, teacher_dir
):
    """With task_coef 0 every token's advantage is log p_teacher - log p_student: their mean is minus the
    mean reverse KL, iteration by iteration (that the estimator converges: tests/components/test_rl.py). The
    teacher here runs in an actor of its own (distill.placement=separate)."""
    series = _distil(local_root, tiny_model_dir, teacher_dir, "opd_rkl", "distill.placement=separate")
    kl, adv = series("distill/reverse_kl"), series("critic/advantages/mean")
    assert len(kl) == ITERS and kl[0] > 0.01
    assert adv == pytest.approx([-k for k in kl], abs=1e-5)
    assert len(series("timing_s/teacher")) == ITERS


def test_a_distillation_preset_without_a_teacher_is_one_line(local_root, tiny_model_dir):
    with pytest.raises(
        ConfigError, match=r"algorithm\.name=opd distils from a teacher: set distill\.teacher_path"
    ):
        load_checked(None, overrides(local_root, "opd_none", tiny_model_dir, "algorithm.name=opd"))
    with pytest.raises(ConfigError, match=r"distill\.loss=jsd needs the teacher's whole distributions"):
        load_checked(None, ["distill.loss=jsd", "distill.placement=separate"])


def test_a_teacher_with_another_tokenizer_is_refused_naming_the_key(local_root, tiny_model_dir, tmp_path):
    other = build_char_tokenizer(tool_tokens=True)  # four more tokens: other ids
    save_pretrained(make_model(other, seed=3), other, tmp_path)
    with pytest.raises(ConfigError, match=r"distill\.teacher_path=.*: its tokenizer is not the student's"):
        load_checked(
            None, overrides(local_root, "opd_bad", tiny_model_dir, f"distill.teacher_path={tmp_path}")
        )
