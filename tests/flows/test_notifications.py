"""A person hears about an unattended pipeline: Prefect's automations, set up from pipelines.yaml's `notify:`,
POST a message to a webhook (here a local HTTP receiver) when a run of the pipeline fails or its nightly does
not promote its model. Through the real Prefect server (its triggers and actions services)."""

from __future__ import annotations

import time

import pytest

from bench.soak import Receiver
from components.errors import ConfigError
from flows.notifications import Notify, announce_not_promoted, configure


@pytest.fixture()
def receiver():
    r = Receiver()
    yield r
    r.close()


def test_a_failed_nightly_run_is_one_message_naming_the_pipeline_run_cause_and_link(
    receiver, prefect_harness
):
    """A run of the pipeline fails on a user's error: the webhook gets one message with the pipeline, the flow
    run's name, its state, the one-line cause and the run's link."""
    from prefect import tags

    from flows.nightly import nightly_flow

    configure("nightly-failing", "rl-nightly", Notify(webhook=receiver.url, on=["failed"]))
    with tags("pipeline:nightly-failing"):
        state = nightly_flow("configs/arith_grpo.yaml", ["algorithm.name=no-such-preset"], return_state=True)
    assert state.is_failed()
    (message,) = receiver.wait(1)
    run = state.state_details.flow_run_id
    text = message["text"]
    assert message["subject"] == "reinforge: pipeline nightly-failing failed"
    assert text.startswith("reinforge: pipeline nightly-failing failed\npipeline nightly-failing: flow run ")
    assert "(rl-nightly) ended Failed: " in text and "no-such-preset" in text
    assert str(run) in text.splitlines()[-1]  # the link to the run
    time.sleep(3)
    assert len(receiver.received) == 1  # one message for one failure


def test_a_model_not_promoted_is_one_message_with_its_reason(receiver, prefect_harness):
    from prefect import flow, tags

    configure("nightly-kept", "rl-nightly", Notify(webhook=receiver.url, on=["not_promoted"]))
    decision = {
        "name": "reinforge-arith",
        "version": "7",
        "alias": "challenger",
        "reason": "its held-out acc is nan: a non-finite metric never promotes",
    }

    @flow(name="rl-nightly")
    def registered():
        announce_not_promoted(decision)

    with tags("pipeline:nightly-kept"):
        registered()
    (message,) = receiver.wait(1)
    assert message["subject"] == "reinforge: pipeline nightly-kept did not promote its model"
    body = message["body"]
    assert body.startswith("pipeline nightly-kept: flow run ")
    assert "registered reinforge-arith v7 as challenger, not champion: its held-out acc is nan" in body


def test_notifications_of_another_pipeline_are_not_sent(receiver, prefect_harness):
    from prefect import tags

    from flows.nightly import nightly_flow

    configure("nightly-quiet", "rl-nightly", Notify(webhook=receiver.url))
    with tags("pipeline:some-other"):
        nightly_flow("configs/arith_grpo.yaml", ["algorithm.name=no-such-preset"], return_state=True)
    time.sleep(8)
    assert receiver.received == []


def test_a_webhook_is_a_url_or_a_variable_that_is_set(monkeypatch, tmp_path):
    from flows.deploy import load_pipelines

    bad = tmp_path / "pipelines.yaml"
    bad.write_text(
        "pipelines:\n  - {name: n, version: '1', flow: nightly, config: configs/arith_grpo.yaml, "
        "notify: {webhook: 'hooks.example/x'}}\n"
    )
    with pytest.raises(ConfigError, match=r"pipelines\.0\.notify\.webhook: .*neither an http\(s\) URL"):
        load_pipelines(bad)
    notify = Notify(webhook="${REINFORGE_TEST_HOOK}")
    monkeypatch.delenv("REINFORGE_TEST_HOOK", raising=False)
    with pytest.raises(ConfigError, match=r"pipeline n: notify.webhook=\$\{REINFORGE_TEST_HOOK\}, but"):
        notify.url("n")
    monkeypatch.setenv("REINFORGE_TEST_HOOK", "https://hooks.example/x")
    assert notify.url("n") == "https://hooks.example/x"


def test_a_run_left_running_by_a_dead_process_is_crashed_by_the_next_nightly_and_reported(
    receiver, prefect_harness
):
    """A nightly whose process was killed (or whose server died under it) stays Running on the server and
    tells nobody. The next nightly, holding the pipeline's lock, marks it Crashed with why; the pipeline's
    notification reports it. Its own run is left alone."""
    from prefect import flow, get_client, tags
    from prefect.states import Running

    from flows.notifications import crash_abandoned

    configure("nightly-abandoned", "rl-nightly", Notify(webhook=receiver.url, on=["failed"]))

    @flow(name="rl-nightly")
    def next_night():
        return crash_abandoned("nightly-abandoned")

    with get_client(sync_client=True) as client:
        dead = client.create_flow_run(next_night, tags=["pipeline:nightly-abandoned"], state=Running())
        with tags("pipeline:nightly-abandoned"):
            crashed = next_night()
        assert crashed == [dead.name]
        state = client.read_flow_run(dead.id).state
    assert state.type.value == "CRASHED" and "ended without reporting how" in state.message
    (message,) = receiver.wait(1)
    assert f"flow run {dead.name} (rl-nightly) ended Crashed: the process running it ended" in message["body"]
