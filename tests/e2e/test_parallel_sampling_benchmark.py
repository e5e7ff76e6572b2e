"""benchmarks/parallel_sampling.py on a tiny workload: it times n against separate requests on the same prompts,
n computes fewer tokens, and it compares each completion with its separate, seeded request's."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import parallel_sampling

pytestmark = pytest.mark.timeout(300)


def test_the_benchmark_times_n_beside_separate_requests_and_their_completions_agree(model_dir, tmp_path, capsys):
    out = tmp_path / "parallel.json"
    assert parallel_sampling.main(["--model", str(model_dir), "--num-prompts", "2", "--prompt-len", "40", "--n", "3",
                                   "--max-tokens", "4", "--repeats", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [len(report["seconds"][name]) for name in ("splitserve n", "separate requests")] == [2, 2]
    assert report["num_completions"] == 6 and report["output_tokens"]["splitserve n"] == 2 * 3 * 4
    assert report["identical_completions"] + len(report["parted_at"]) == 6
    # The prompts once and each other completion's last prompt token, then the decodes; separately, each prompt's
    # 40 tokens three times (the prefix cache's whole 128-token blocks hold none of them).
    assert report["computed_tokens"] == {"splitserve n": 2 * 40 + 2 * 2 + 2 * 3 * 3,
                                         "separate requests": 2 * 3 * 40 + 2 * 3 * 3}
    printed = capsys.readouterr().out
    assert re.search(r"separate requests\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+258", printed), printed
    assert re.search(r"completions equal to their separate request's \(seed \+ i\): \d/6", printed), printed
    with pytest.raises(SystemExit):
        parallel_sampling.main(["--model", str(model_dir), "--n", "0"])
