"""Telling a person when an unattended pipeline needs one, with Prefect's own automations.

A pipeline with `notify: {webhook: URL}` in pipelines.yaml gets, at `reinforge deploy`, a Custom Webhook
notification block and up to two automations on the Prefect server. Both match the pipeline's tag
(`pipeline:<name>`, on every run of its deployment, however it is served), so they hold for in-process
serving, a work pool, and `prefect deploy` alike:

- `failed`: a flow run of the pipeline entered Failed, Crashed or TimedOut. The message names the pipeline, the
  run, its state and the one-line cause (the state's message), and links the run in the UI.
- `not_promoted`: the nightly registered a model that did not take the `champion` alias (event
  `reinforge.model.not-promoted`, emitted by the run); the message gives the version and why.

The server sends them (its triggers and actions services), so a run whose process was killed is reported too.
"""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from components.errors import ConfigError

NOT_PROMOTED = "reinforge.model.not-promoted"
FAILED_STATES = ("Failed", "Crashed", "TimedOut")
_ENV = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")


class Notify(BaseModel):
    """pipelines.yaml `notify:` of one pipeline."""

    model_config = ConfigDict(extra="forbid")
    webhook: str = Field(
        description="URL the messages are POSTed to as JSON ({text, subject, body}: Slack's and most chat "
        "tools' incoming webhooks read `text`), or ${VARIABLE} to read it from the environment at deploy"
    )
    on: list[Literal["failed", "not_promoted"]] = Field(
        default_factory=lambda: ["failed", "not_promoted"],
        description="which events send a message",
    )

    @field_validator("webhook")
    @classmethod
    def is_a_url_or_variable(cls, value: str) -> str:
        if _ENV.match(value) or re.match(r"^https?://[^\s/]+", value):
            return value
        raise ValueError(f"{value!r} is neither an http(s) URL nor ${{VARIABLE}}")

    def url(self, pipeline: str) -> str:
        """The webhook's URL, read from the environment when given as ${VARIABLE}."""
        found = _ENV.match(self.webhook)
        if not found:
            return self.webhook
        value = os.environ.get(found.group(1))
        if not value:
            raise ConfigError(
                f"pipeline {pipeline}: notify.webhook={self.webhook}, but {found.group(1)} is not set. Export it "
                "(the webhook's URL) before `reinforge deploy`, or give the URL itself."
            )
        return value


def tag_of(pipeline: str) -> str:
    """The tag every run of the pipeline's deployment carries (flows/deploy.py)."""
    return f"pipeline:{pipeline}"


def ui_base() -> str:
    """The Prefect UI's address as this client sees it: PREFECT_UI_URL, else the API's URL without /api."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    return (ui or (PREFECT_API_URL.value() or "").removesuffix("/").removesuffix("/api")).rstrip("/")


def run_link() -> str:
    """The run's page: the server's own UI link when it knows its UI's address, else one from this client's."""
    return f"{{{{ (flow_run|ui_url) or '{ui_base()}/runs/flow-run/' ~ flow_run.id }}}}"


def failed_body(pipeline: str) -> str:
    return (
        f"pipeline {pipeline}: flow run {{{{ flow_run.name }}}} ({{{{ flow.name }}}}) ended "
        "{{ flow_run.state.name }}: {{ flow_run.state.message }}\n" + run_link()
    )


def not_promoted_body(pipeline: str) -> str:
    return (
        f"pipeline {pipeline}: flow run {{{{ flow_run.name }}}} registered {{{{ event.payload.model }}}} "
        "v{{ event.payload.version }} as {{ event.payload.alias }}, not champion: {{ event.payload.reason }}"
        "\n" + run_link()
    )


def automations_of(pipeline: str, flow_name: str, notify: Notify, block_id) -> list:
    """The automations `notify` asks for, each sending through the notification block `block_id`. A failure
    is the pipeline's own flow run's (`flow_name`): its subflows carry its tag, and one failure is one
    message."""
    from datetime import timedelta

    from prefect.automations import Automation, EventTrigger, Posture, SendNotification

    def one(name: str, expect: set[str], subject: str, body: str, *more: dict) -> Automation:
        trigger = EventTrigger(
            expect=expect,
            match_related=[{"prefect.resource.id": f"prefect.tag.{tag_of(pipeline)}"}, *more],
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        )
        action = SendNotification(block_document_id=block_id, subject=subject, body=body)
        return Automation(name=f"reinforge {pipeline}: {name}", trigger=trigger, actions=[action])

    made = []
    if "failed" in notify.on:
        states = {f"prefect.flow-run.{s}" for s in FAILED_STATES}
        subject = f"reinforge: pipeline {pipeline} failed"
        of_flow = {"prefect.resource.role": "flow", "prefect.resource.name": flow_name}
        made.append(one("run failed", states, subject, failed_body(pipeline), of_flow))
    if "not_promoted" in notify.on:
        subject = f"reinforge: pipeline {pipeline} did not promote its model"
        made.append(one("model not promoted", {NOT_PROMOTED}, subject, not_promoted_body(pipeline)))
    return made


def configure(pipeline: str, flow_name: str, notify: Notify) -> list[str]:
    """Save the pipeline's webhook block and (re)create its automations on the Prefect server (an earlier
    deploy's of the same names are replaced). Returns the automations' names."""
    from prefect.automations import Automation
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = CustomWebhookNotificationBlock(
        name=f"reinforge {pipeline}",
        url=notify.url(pipeline),
        json_data={"text": "{{subject}}\n{{body}}", "subject": "{{subject}}", "body": "{{body}}"},
    )
    block_id = block.save(f"reinforge-{pipeline}", overwrite=True)
    names = []
    for automation in automations_of(pipeline, flow_name, notify, block_id):
        while True:  # an earlier deploy's, however many
            try:
                Automation.read(name=automation.name).delete()
            except ValueError:  # none (left) of that name
                break
        automation.create()
        names.append(automation.name)
    return names


def announce_not_promoted(decision: dict) -> None:
    """Emit the event a pipeline's `not_promoted` automation listens for (from inside its flow run: Prefect
    relates the event to the run, its deployment and its tags)."""
    from prefect.events import emit_event

    emit_event(
        NOT_PROMOTED,
        resource={
            "prefect.resource.id": f"reinforge.model.{decision['name']}.{decision['version']}",
            "prefect.resource.name": f"{decision['name']} v{decision['version']}",
        },
        payload={
            "model": decision["name"],
            "version": decision["version"],
            "alias": decision["alias"],
            "reason": decision["reason"],
        },
    )


def crash_abandoned(pipeline: str) -> list[str]:
    """The pipeline's flow runs the server still holds Running (this one's excepted), marked Crashed with why.
    Called while this run holds the pipeline's lock, so no process runs them: they were killed, or their Prefect
    server died under them and never heard how they ended. Crashed is a state change the `failed` automation
    reports (for the pipeline's own flow; its subflows are tidied without a message of their own), a night late
    but not never. Returns their names."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.runtime import flow_run
    from prefect.states import Crashed

    mine = str(flow_run.id)
    running = FlowRunFilter(
        tags=FlowRunFilterTags(all_=[tag_of(pipeline)]),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING])),
    )
    with get_client(sync_client=True) as client:
        abandoned = [r for r in client.read_flow_runs(flow_run_filter=running) if str(r.id) != mine]
        for run in abandoned:
            why = (
                "the process running it ended without reporting how (killed, or its Prefect server died); "
                f"found by flow run {flow_run.name}, which holds the pipeline's lock now"
            )
            client.set_flow_run_state(run.id, Crashed(message=why), force=True)
    return [r.name for r in abandoned]
