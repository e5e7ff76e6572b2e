"""benchmarks/structured_outputs.py on a tiny workload: it times both kinds on the same token counts, and every
constrained answer follows the schema."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import structured_outputs

pytestmark = pytest.mark.timeout(300)


def test_the_benchmark_times_both_kinds_and_every_answer_follows_the_schema(model_dir, tmp_path, capsys):
    out = tmp_path / "structured.json"
    assert structured_outputs.main(["--model", str(model_dir), "--num-prompts", "3", "--repeats", "2",
                                    "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    timings = report["timings"]["splitserve"]
    assert len(timings["shaped"]) == len(timings["plain"]) == 2 and min(timings["shaped"] + timings["plain"]) > 0
    assert report["tokens"]["splitserve"] == sum(len(ids) for ids in report["answers"]["splitserve"]) > 0
    printed = capsys.readouterr().out
    assert re.search(r"\| splitserve \| [\d.]+ \| [\d.]+ \| [\d.]+x \| 3/3 \|", printed), printed


def test_follows_schema_checks_keys_types_and_bounds():
    assert structured_outputs.follows_schema('{"name": "Ada", "age": 36, "tags": ["math"]}')
    for text in ('{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 121, "tags": []}',
                 '{"name": "Ada", "age": 3.5, "tags": []}', '{"name": "Ada", "age": 1, "tags": [1]}',
                 '{"name": "Ada", "age": 1, "tags": [], "x": 0}', '{"name": "Ada"', "[]"):
        assert not structured_outputs.follows_schema(text), text
    assert structured_outputs.without_trailing([5, 6, 2], {2}) == [5, 6]
    assert structured_outputs.without_trailing([5, 2, 6], {2}) == [5, 2, 6]
