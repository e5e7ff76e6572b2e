"""benchmarks/beam_search.py on a tiny workload: it times splitserve and transformers on the same prompts, and
every prompt's beams are transformers'."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import beam_search

pytestmark = pytest.mark.timeout(300)


def test_the_benchmark_times_both_systems_and_the_beams_are_transformers(model_dir, tmp_path, capsys):
    out = tmp_path / "beams.json"
    assert beam_search.main(["--model", str(model_dir), "--num-prompts", "2", "--beam-width", "3",
                             "--max-tokens", "6", "--repeats", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [len(report["seconds"][name]) for name in ("splitserve", "transformers")] == [2, 2]
    assert min(report["seconds"]["splitserve"] + report["seconds"]["transformers"]) > 0
    assert report["identical_prompts"] == {"transformers": 2} and report["num_prompts"] == 2
    printed = capsys.readouterr().out
    assert re.search(r"transformers\s+[\d.]+\s+[\d.]+x\s+2/2", printed), printed
    with pytest.raises(SystemExit):
        beam_search.main(["--model", str(model_dir), "--num-prompts", "0"])
