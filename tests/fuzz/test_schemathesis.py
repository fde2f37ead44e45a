"""Schemathesis against a live gateway, from its own /openapi.json, while a bystander tenant streams.

Every operation of the document is fuzzed with schema-valid (positive) and schema-violating (negative)
requests carrying the fuzzer tenant's key; about three in four JSON bodies name the served model, so
they get past model resolution towards the engine. Checks on every response: no 5xx
(`not_a_server_error`), the documented content type and body schema (`response_schema_conformance`:
every 4xx/5xx body is OpenAI's error shape, checked again here by hand; each SSE event of a stream).
A failing request is recorded and the run goes on, so one run lists every failure it met. Meanwhile the bystander's streamed greedy completions must equal its quiet-run stream,
token for token. Hypothesis is derandomized (no example database), so a run is the same every time.

CI-sized: EXAMPLES per operation and mode. The longer run (LONG_EXAMPLES):
`pytest -m 'fuzz and long' tests/fuzz -s`.
Each run prints how many requests it sent over how many operations (`-s`).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from tests.fuzz.bystander import Bystander
from tests.fuzz.openai_errors import error_shape_problem
from tests.gateway.conftest import BASE_MODEL

pytestmark = [pytest.mark.fuzz, pytest.mark.xdist_group("fuzz")]

EXAMPLES = 10  # per operation and mode: about 15 s on 2 cores (25 take about 35 s)
LONG_EXAMPLES = 300
CHECKS = [not_a_server_error, content_type_conformance, response_schema_conformance]


@dataclass
class FuzzReport:
    requests: int = 0
    operations: set[str] = field(default_factory=set)
    statuses: Counter = field(default_factory=Counter)
    codes: Counter = field(default_factory=Counter)  # the error codes of the 4xx/5xx answers
    examples: dict[str, str] = field(default_factory=dict)  # one message per (operation, mode, code)
    failures: list[str] = field(default_factory=list)  # one line per failing request: what, and how to repeat it

    def summary(self) -> str:
        return (f"schemathesis: {self.requests} requests over {len(self.operations)} operations "
                f"(statuses {dict(sorted(self.statuses.items()))}), {len(self.failures)} failures")


def fuzz_operation(stack, operation, mode: GenerationMode, examples: int, session: requests.Session,
                   report: FuzzReport) -> None:
    """`examples` requests of one operation in one generation mode; failures go to the report."""
    headers = stack.headers(stack.fuzzer_key)

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode), real_model=st.sampled_from([True, True, True, False]))
    def run(case, real_model: bool) -> None:
        if real_model and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = BASE_MODEL
        response = case.call(base_url=stack.url, headers=headers, session=session, timeout=120)
        report.requests += 1
        report.operations.add(operation.label)
        report.statuses[response.status_code] += 1
        if response.status_code >= 400 and error_shape_problem(response.status_code, response.text) is None:
            error = response.json()["error"]
            report.codes[error["code"]] += 1
            report.examples.setdefault(f"{operation.label} [{mode.value}] {error['code']}", error["message"][:160])
        problems = []
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except (Failure, FailureGroup) as e:
            problems.append(" ".join(str(e).split())[:400])
        if (shape := error_shape_problem(response.status_code, response.text)) is not None:
            problems.append(shape)
        if problems:
            body = json.dumps(case.body, default=repr)[:300] if case.body is not None else "-"
            report.failures.append(f"{operation.label} [{mode.value}] {response.status_code}: "
                                   f"{'; '.join(problems)} | body {body}")

    run()


def fuzz(stack, examples: int) -> FuzzReport:
    schema = schemathesis.openapi.from_url(stack.url + "/openapi.json")
    schema.validate()
    report = FuzzReport()
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            # NOTE: only a body can be made schema-invalid here (path parameters are any string)
            negative = (GenerationMode.NEGATIVE,) if operation.body else ()
            for mode in (GenerationMode.POSITIVE, *negative):
                started, before, codes = time.monotonic(), Counter(report.statuses), Counter(report.codes)
                fuzz_operation(stack, operation, mode, examples, session, report)
                print(f"  {operation.label} [{mode.value}]: {dict(sorted((report.statuses - before).items()))}, "
                      f"{time.monotonic() - started:.1f} s; codes {dict((report.codes - codes).most_common())}")
    return report


def fuzz_beside_bystander(stack, examples: int) -> None:
    bystander = Bystander(stack.url, stack.bystander_key)
    reference = bystander.reference()
    with bystander.running():
        report = fuzz(stack, examples)
    print(f"\n{report.summary()}; bystander: {len(bystander.streams)} streams")
    for what, message in sorted(report.examples.items()):
        print(f"  e.g. {what}: {message}")
    for line in report.failures[:50]:
        print("  FAIL", line)
    assert report.operations and report.requests >= len(report.operations) * examples
    assert not report.failures, report.failures[:10]
    assert not bystander.failures, bystander.failures[:5]
    assert len(bystander.streams) >= 2, "the bystander must stream while the fuzzer runs"
    casualties = bystander.casualties(reference)
    assert not casualties, (reference, casualties[:3])


def test_fuzz_the_public_api_while_a_bystander_streams(fuzz_stack):
    fuzz_beside_bystander(fuzz_stack, EXAMPLES)


@pytest.mark.long
def test_fuzz_the_public_api_longer(fuzz_stack):
    fuzz_beside_bystander(fuzz_stack, LONG_EXAMPLES)
