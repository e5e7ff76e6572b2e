"""benchmarks/serving.py's goodput: DistServe's test of each request against the TTFT and ITL objectives."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("serving_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py")
serving = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = serving  # its dataclasses look their module up while being built
_SPEC.loader.exec_module(serving)


def record(sent: float, first: float | None, itls: list[float], finished: float | None = None):
    result = serving.RequestRecord(prompt_len=8, sent=sent, first_token=first, itls=itls, num_tokens=len(itls) + 1)
    result.finished = finished if finished is not None else (first or 0) + sum(itls)
    if first is None:
        result.finished = None
    return result


@pytest.mark.parametrize(("ttft", "itls", "meets"), [
    (0.5, [0.05, 0.05], True),
    (2.0, [0.1, 0.1], True),            # on both objectives: within
    (2.01, [0.01], False),              # first token late
    (0.1, [0.05, 0.16], False),         # mean ITL 0.105 s: over, though most gaps are fine
    (0.1, [], True),                    # a one-token reply has no gap
])
def test_a_request_meets_the_objectives_only_when_both_hold(ttft, itls, meets):
    assert serving.meets_slo(record(10.0, 10.0 + ttft, itls), slo_ttft=2.0, slo_itl=0.1) is meets


def test_goodput_counts_requests_within_both_objectives_over_the_runs_span():
    records = [record(0.0, 0.5, [0.05] * 9), record(1.0, 4.0, [0.05] * 9), record(2.0, 2.2, [0.2] * 9),
               record(3.0, None, [])]  # within; TTFT too late; ITL too slow; failed
    result = serving.summarize("disaggregated", "short", records, rate=1.0, slo_ttft=2.0, slo_itl=0.1)
    span = max(r.finished for r in records if r.finished) - 0.0
    assert result.num_within_slo == 1 and result.num_requests == 4 and result.num_errors == 1
    assert result.goodput == pytest.approx(1 / span)
