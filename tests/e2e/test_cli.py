"""The `splitserve` command, run as a real process."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.reference import hf_beams, hf_prompt_logprobs

SMALL_ENGINE = ["--kv-cache-gb", "0.1", "--max-model-len", "512"]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "splitserve.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_single_prompt_streams_text(model_dir, tokenizer):
    result = run_cli("generate", "The capital of France is", "--max-tokens", "4", *SMALL_ENGINE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(" Paris")
    assert "[length]" in result.stderr
    paris = tokenizer.encode(" Paris")[0]
    banned = run_cli("generate", "The capital of France is", "--max-tokens", "4", "--logit-bias", f"{paris}=-100",
                     *SMALL_ENGINE)
    assert banned.returncode == 0, banned.stderr
    assert banned.stdout and not banned.stdout.startswith(" Paris")
    worded = run_cli("generate", "The capital of France is", "--max-tokens", "4", "--bad-word", "Paris",
                     "--stop", ".", "--include-stop-str-in-output", "--allowed-token-id", str(paris),
                     "--allowed-token-id", str(tokenizer.encode(".")[0]), *SMALL_ENGINE)
    assert worded.returncode == 0 and worded.stdout.startswith(".") and "[stop" in worded.stderr, worded.stderr
    scored = run_cli("generate", "The capital of France is", "--max-tokens", "1", "--prompt-logprobs", "0",
                     *SMALL_ENGINE)
    assert scored.returncode == 0, scored.stderr
    ids = tokenizer.encode("The capital of France is")
    reference = hf_prompt_logprobs(str(model_dir), tuple(ids))
    total = sum(reference[position - 1, ids[position]].item() for position in range(1, len(ids)))
    line = re.search(r"\[prompt: (\d+) tokens scored, log-likelihood (\S+)\]", scored.stderr)
    assert int(line[1]) == len(ids) - 1 and float(line[2]) == pytest.approx(total, abs=1e-3)


def test_jsonl_batch_writes_one_result_a_line(tmp_path, model_dir, tokenizer):
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "The capital of France is", "max_tokens": 3},
        {"prompt_token_ids": tokenizer.encode("Water boils at")},
        {"messages": [{"role": "user", "content": "Say hi"}], "logprobs": 2, "prompt_logprobs": 1},
        {"prompt": "The capital of France is", "max_tokens": 3, "logit_bias": {str(tokenizer.encode(" Paris")[0]): -100}},
        {"prompt": "Once upon a time", "n": 3, "seed": 4, "temperature": 1.0},  # a record a completion
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    output = tmp_path / "out.jsonl"
    result = run_cli("generate", "--file", str(prompts), "--output", str(output), "--max-tokens", "5", *SMALL_ENGINE)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 4 + 3
    assert [record["index"] for record in records[4:]] == [0, 1, 2] and "index" not in records[0]
    assert {record["prompt"] for record in records[4:]} == {"Once upon a time"}
    assert len({tuple(record["token_ids"]) for record in records[4:]}) > 1
    assert len(records[0]["token_ids"]) == 3 and records[0]["text"].startswith(" Paris")
    assert records[3]["token_ids"][0] != records[0]["token_ids"][0]  # the line's logit_bias banned " Paris"
    assert records[1]["num_prompt_tokens"] == len(tokenizer.encode("Water boils at"))
    assert len(records[2]["logprobs"]) == len(records[2]["token_ids"])
    assert "<|im_start|>assistant" in records[2]["prompt"]
    prompt_logprobs = records[2]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and all(len(entry) in (1, 2) for entry in prompt_logprobs[1:])
    assert "prompt_logprobs" not in records[0]


def test_structured_outputs_flags_and_jsonl_lines_shape_the_output(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                                  "required": ["name"], "additionalProperties": False}))
    shaped = run_cli("generate", "A person, as JSON:", "--json-schema", f"@{schema}", *SMALL_ENGINE)
    assert shaped.returncode == 0, shaped.stderr
    assert set(json.loads(shaped.stdout)) == {"name"} and "[stop]" in shaped.stderr
    chosen = run_cli("generate", "Is Paris in France? Answer:", "--choice", " yes", "--choice", " no", *SMALL_ENGINE)
    assert chosen.returncode == 0 and chosen.stdout.strip() in ("yes", "no"), chosen.stderr
    prompts, output = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(json.dumps({"prompt": "Pick a date:", "max_tokens": 10,
                                   "structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}"}})
                       + "\n" + json.dumps({"prompt": "Hello"}) + "\n")
    result = run_cli("generate", "--file", str(prompts), "--output", str(output), "--max-tokens", "4", *SMALL_ENGINE)
    assert result.returncode == 0, result.stderr
    dated, plain = [json.loads(line) for line in output.read_text().splitlines()]
    assert re.fullmatch("[0-9]{4}-[0-9]{2}", dated["text"]) and dated["finish_reason"] == "stop"
    assert plain["finish_reason"] == "length"
    refused = run_cli("generate", "hello", "--regex", "[0-")
    assert refused.returncode == 2 and "the regex is not valid" in refused.stderr
    both = run_cli("generate", "hello", "--regex", "a", "--json-object")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_bad_input_gives_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    result = run_cli("generate", "--file", str(bad))
    assert result.returncode == 2
    assert "bad.jsonl:2: not valid JSON" in result.stderr
    result = run_cli("generate", "hello", "--temperature", "-1")
    assert result.returncode == 2
    assert "temperature must be a finite number >= 0" in result.stderr
    result = run_cli("generate")
    assert result.returncode == 2 and "at least one prompt" in result.stderr
    result = run_cli("generate", "hello", "--logit-bias", "5:3")
    assert result.returncode == 2 and "expected ID=BIAS" in result.stderr
    result = run_cli("generate", "hello", "--logit-bias", "5=300")
    assert result.returncode == 2 and "logit_bias values must be numbers in [-100, 100]" in result.stderr


def test_help_lists_every_command():
    result = run_cli("--help")
    assert result.returncode == 0
    assert "generate" in result.stdout and "prepare-model" in result.stdout


def test_workers_take_a_kv_checksum_setting():
    from splitserve.rpc.worker_config import WorkerConfig

    for command in ("prefill", "decode"):
        result = run_cli(command, "--help")
        assert result.returncode == 0 and "--kv-checksum {xxh3,none}" in result.stdout
    assert "--kv-checksum" in run_cli("up", "--help").stdout
    assert WorkerConfig(kv_checksum="none").kv_checksum == "none"
    with pytest.raises(ValueError, match="kv_checksum must be one of xxh3, none, got 'md5'"):
        WorkerConfig(kv_checksum="md5")


def test_beam_search_writes_a_record_a_beam_as_transformers_finds_them(tmp_path, model_dir, tokenizer):
    """--beam-width: each prompt's beams, best first, transformers' (float32, length penalty 1); a JSONL line's
    max_tokens is its search's; sampling flags a search does not take are refused with a sentence."""
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "The capital of France is"}, {"prompt": "Water boils at", "max_tokens": 4}]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    output = tmp_path / "beams.jsonl"
    result = run_cli("generate", "--file", str(prompts), "--output", str(output), "--max-tokens", "6",
                     "--beam-width", "3", "--logprobs", "1", *SMALL_ENGINE)
    assert result.returncode == 0, result.stderr
    assert "Beam search" in result.stderr  # one progress bar a search
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [(record["prompt"], record["index"]) for record in records] == [
        (line["prompt"], index) for line in lines for index in range(3)]
    for line, found in zip(lines, (records[:3], records[3:])):
        ids = tokenizer.encode(line["prompt"])
        assert [record["token_ids"] for record in found] == hf_beams(str(model_dir), ids, 3, line.get("max_tokens", 6))
        assert all(record["num_prompt_tokens"] == len(ids) for record in found)
        for record in found:  # each token's log probability (and the best of its step's candidates): transformers'
            reference = hf_prompt_logprobs(str(model_dir), tuple(ids + record["token_ids"]))
            for offset, (token, step) in enumerate(zip(record["token_ids"], record["logprobs"], strict=True)):
                assert step[str(token)] == pytest.approx(reference[len(ids) + offset - 1, token].item(), abs=1e-3)
                assert max(step.values()) == pytest.approx(reference[len(ids) + offset - 1].max().item(), abs=1e-3)
        if len({len(record["token_ids"]) for record in found}) == 1:  # best first (the length penalty moot)
            scores = [record["cum_logprob"] for record in found]
            assert scores == sorted(scores, reverse=True)
    printed = run_cli("generate", "The capital of France is", "--max-tokens", "4", "--beam-width", "2", *SMALL_ENGINE)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.count("--- 'The capital of France is' [beam ") == 2
    for flags, message in ((["--temperature", "0.7"], "takes only max_tokens, ignore_eos and logprobs"),
                           (["--logprobs", "5"], "at most 2 x --beam-width"), (["--beam-width", "11"], "beam_width")):
        refused = run_cli("generate", "hello", *(["--beam-width", "2"] if "--beam-width" not in flags else []),
                          *flags, *SMALL_ENGINE)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    alone = run_cli("generate", "hello", "--length-penalty", "2")
    assert alone.returncode == 2 and "--length-penalty is for a beam search" in alone.stderr
