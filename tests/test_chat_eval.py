"""Chat-aware evaluation: lm-eval prompts rendered with the chat template, the answer-quality check (greedy answers
of FP, fake-quant and the .pte to held-out conversations: exact match, ROUGE-L, token F1, agreement with FP, with
bootstrap intervals), its summary section and report section, and plain-text runs left as they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qharness.checks.answers import exact_match, lcs_length, rouge_l, score_answers, token_f1, words
from qharness.checks.stats import bootstrap_interval
from qharness.config import EvalConfig
from qharness.errors import UserError

DATA = Path(__file__).parent / "data"


@pytest.mark.fast
def test_exact_match_token_f1_and_rouge_l_on_known_strings():
    assert words("Return the SUM, of x_1!") == ["return", "the", "sum", "of", "x_1"]
    assert exact_match("The sum.", "the  SUM") == 1.0 and exact_match("the sum", "the sums") == 0.0
    # 2 shared words; precision 2/3, recall 2/3
    assert token_f1("Return the sum.", "return the total") == pytest.approx(2 / 3)
    # shared as a multiset: "a a b" vs "a b b" share a, b -> P = R = 2/3
    assert token_f1("a a b", "a b b") == pytest.approx(2 / 3)
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0 and token_f1("x", "y") == 0.0
    assert lcs_length("a b c d".split(), "a c d e".split()) == 3
    assert lcs_length("x a y b".split(), "a b".split()) == 2 and lcs_length([], ["a"]) == 0
    assert rouge_l("a b c d", "a c d e") == pytest.approx(0.75)  # LCS 3: P = R = 3/4
    # order matters for ROUGE-L, not for token F1: "d c b a" vs "a b c d" share every word but an LCS of 1
    assert token_f1("d c b a", "a b c d") == 1.0 and rouge_l("d c b a", "a b c d") == pytest.approx(0.25)
    # P = 2/2, R = 2/4 -> F = 2/3
    assert rouge_l("a b", "a x b y") == pytest.approx(2 / 3)


@pytest.mark.fast
def test_bootstrap_interval_holds_the_mean_keeps_bounds_and_narrows_with_more_items():
    values = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    lo, hi = bootstrap_interval(values)
    assert 0.0 <= lo < sum(values) / len(values) < hi <= 1.0
    assert bootstrap_interval(values) == [lo, hi]  # a fixed seed: the same interval each time
    assert bootstrap_interval([0.5] * 10) == [0.5, 0.5]
    assert bootstrap_interval([1.0]) is None
    wide = bootstrap_interval([1.0, 0.0] * 5)
    narrow = bootstrap_interval([1.0, 0.0] * 200)
    assert narrow[1] - narrow[0] < (wide[1] - wide[0]) / 3  # ~1/sqrt(40) of it


@pytest.mark.fast
def test_scores_compare_each_model_with_the_references_and_with_fp():
    refs = ["the sum of a and b", "a sorted list", "the number of items"]
    answers = {
        "fp": ["the sum of a and b", "a list", "nothing"],
        "pte": ["the sum of a and b", "a list", "the number of items"],
    }
    scores = score_answers(answers, refs)
    assert scores["fp"].exact_match.mean == pytest.approx(1 / 3) and scores["fp"].fp_exact_match is None
    assert scores["pte"].exact_match.mean == pytest.approx(2 / 3)
    assert scores["pte"].fp_exact_match.mean == pytest.approx(2 / 3)  # same answer as FP on 2 of 3
    f1 = [1.0, 2 * (2 / 2 * 2 / 3) / (2 / 2 + 2 / 3), 0.0]  # "a list" vs "a sorted list": P 1, R 2/3
    assert scores["fp"].token_f1.mean == pytest.approx(sum(f1) / 3)
    lo, hi = scores["pte"].rouge_l.ci
    assert lo <= scores["pte"].rouge_l.mean <= hi


@pytest.mark.fast
def test_chat_settings_are_checked_as_config_fields():
    from qharness.schema import RunConfig

    assert EvalConfig().chat_template == "auto" and EvalConfig().answers.limit == 32
    assert EvalConfig(chat_template="auto").uses_chat_template(True) is True
    assert EvalConfig(chat_template="auto").uses_chat_template(False) is False
    assert EvalConfig(chat_template=True).uses_chat_template(False) is True
    for fields, name in (
        ({"answers": {"limit": 0}}, "eval.answers.limit"),
        ({"answers": {"max_new_tokens": 0}}, "eval.answers.max_new_tokens"),
        ({"answers": {"source": "./no/such.jsonl"}}, "eval.answers.source"),
        ({"chat_template": "sometimes"}, "eval.chat_template"),
        ({"system_instruction": "  "}, "eval.system_instruction"),
    ):
        with pytest.raises(UserError, match=name.replace(".", r"\.")):
            RunConfig.from_dict({"eval": fields}).validate()
    long = {"answers": {"max_new_tokens": 64}}
    with pytest.raises(UserError, match=r"eval\.answers\.max_new_tokens=64 leaves no room"):
        RunConfig.from_dict({"data": {"seq_len": 64, "format": "chat"}, "eval": long}).validate()
    RunConfig.from_dict({"data": {"seq_len": 64, "format": "text"}, "eval": long}).validate()  # no answers to give


def test_a_bad_answers_field_is_one_line_before_torch_loads(tmp_path, tiny_llama, corpus):
    from conftest import run_cli, write_config

    cfg = write_config(tmp_path / "run.yaml", tiny_llama, corpus, tmp_path / "run", eval={"enabled": True})
    result = run_cli("fit", "--config", cfg, "--eval.answers.max_new_tokens", "32", "--data.format", "instruction")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: eval.answers.max_new_tokens=32 leaves no room")
    assert "Traceback" not in result.stderr


def _recording_lm(tokenizer, chat_template):
    """A QHarnessLM over flat logits that records the contexts lm-eval hands to ``loglikelihood``."""
    from qharness.evaluation.lm_eval_adapter import BatchedForward, QHarnessLM

    class Recording(QHarnessLM):
        contexts: list[str] = []

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            self.contexts = self.contexts + [r.args[0] for r in requests]
            return super().loglikelihood(requests, disable_tqdm)

    forward = lambda x: torch.zeros(*x.shape, len(tokenizer))  # noqa: E731
    return Recording(BatchedForward(forward, 256, 4), tokenizer, chat_template=chat_template)


@pytest.mark.fast
def test_lm_eval_renders_prompts_with_the_chat_template_and_the_system_instruction(tmp_path, corpus):
    from test_chat_data import CHATML, chat_tokenizer

    from qharness.evaluation.harness import run_eval

    tok = chat_tokenizer("chatml", corpus.read_text()[:20_000])
    texts = [p for p in corpus.read_text()[:60_000].split("\n\n") if len(p) > 200]
    cfg = EvalConfig(tasks=["qharness_mc"], models=["fp"], limit=3, num_fewshot=1, system_instruction="Be brief.")
    chat_lm = _recording_lm(tok, CHATML)
    result = run_eval({"fp": chat_lm}, cfg, texts, tmp_path / "chat")
    rendered = [c for c in chat_lm.contexts if c]  # the empty ones score the choices alone (acc_mutual_info)
    assert len(rendered) >= 3 and all(r.startswith("<|im_start|>system\nBe brief.<|im_end|>") for r in rendered)
    # the few-shot example is an earlier user/assistant exchange, the question the last user turn
    assert all(r.count("<|im_start|>user") == 2 and r.endswith("<|im_start|>assistant\n") for r in rendered)
    assert result["chat_template"] == {"system_instruction": "Be brief.", "fewshot_as_multiturn": True}
    plain_lm = _recording_lm(tok, None)
    plain = run_eval({"fp": plain_lm}, cfg, texts, tmp_path / "plain")
    assert any(plain_lm.contexts) and not any("<|im_start|>" in c for c in plain_lm.contexts)
    assert "chat_template" not in plain  # a plain run's eval.json is as before


def test_a_chat_run_scores_fp_fake_quant_and_pte_answers_on_held_out_conversations(tmp_path):
    from conftest import run_cli, write_config
    from test_chat_data import conversations, make_tiny_chat_llama, write_jsonl

    from qharness.run.summary import RunSummary

    model = make_tiny_chat_llama(tmp_path / "model")
    path = write_jsonl(tmp_path / "chats.jsonl", conversations(200))
    cfg = write_config(
        tmp_path / "run.yaml",
        model,
        path,
        tmp_path / "run",
        data={"seq_len": 48},
        eval={"enabled": True, "tasks": ["qharness_mc"], "limit": 2, "answers": {"limit": 6, "max_new_tokens": 8}},
    )
    result = run_cli("fit", "--config", cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    answers = summary["answers"]
    # the first 6 held-out conversations; those whose prompt + 8 new tokens exceed 48 tokens are skipped
    assert answers["conversations"] >= 2 and answers["conversations"] + answers["skipped"] == 6
    assert f"answer quality ({answers['conversations']} held-out conversations" in result.stdout
    assert set(answers["models"]) == {"fp", "fake_quant", "pte"}
    for kind, scores in answers["models"].items():
        for name in ("exact_match", "rouge_l", "token_f1"):
            lo, hi = scores[name]["ci"]
            assert 0.0 <= lo <= scores[name]["mean"] <= hi <= 1.0
        assert ("fp_token_f1" in scores) == (kind != "fp")
    # held out: the conversations come from the end of the file (the validation split), never from training
    numbers = [int(e["prompt"].split("What is ")[-1].split(" ")[0]) for e in answers["examples"]]
    assert numbers and all(n >= 180 for n in numbers), numbers
    assert all(set(e["answers"]) == {"fp", "fake_quant", "pte"} for e in answers["examples"])
    assert RunSummary.read(tmp_path / "run" / "summary.json").answers.models["pte"].token_f1.ci is not None
    assert "chat_template" in json.loads((tmp_path / "run" / "eval.json").read_text())  # auto: on for chat data


@pytest.mark.fast
def test_plain_text_summaries_and_reports_are_unchanged(tmp_path):
    """A summary without the check writes no ``answers`` key (byte-for-byte the same JSON) and its report has no
    answer section or column."""
    from qharness.reporting.report import write_report
    from qharness.run.summary import RunSummary

    for name in ("summary_v4_qat.json", "summary_v4_ptq_joint.json"):
        data = json.loads((DATA / name).read_text())
        assert RunSummary.from_dict(data).to_dict() == data
        run = tmp_path / "runs" / name.removesuffix(".json")
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps(data))
    result = write_report(tmp_path / "runs", wandb=False)
    assert "Answer quality" not in Path(result["paths"]["markdown"]).read_text()
    assert "answers" not in Path(result["paths"]["csv"]).read_text().splitlines()[0]


@pytest.mark.fast
def test_the_report_shows_each_chat_runs_answer_quality_with_intervals(tmp_path):
    from qharness.checks.answers import Answers
    from qharness.reporting.report import write_report

    refs = ["call it as f(x)", "return the sum", "a sorted list", "the number of items"]
    for name, pte_answers in (
        ("chat-ptq", ["nothing", "return", "a list", "none"]),
        ("chat-qat", ["call it as f(x)", "return the sum", "a list", "the number"]),
    ):
        data = json.loads((DATA / "summary_v4_qat.json").read_text())
        answers = {"fp": ["call it as f(x)", "return the sum", "a list", "items"], "pte": pte_answers}
        data["answers"] = Answers("held-out", 4, 0, 48, score_answers(answers, refs))
        data["mode"] = name.split("-")[1]
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        from qharness.run.summary import RunSummary

        RunSummary.from_dict(data).write(run / "summary.json")
    result = write_report(tmp_path / "runs", wandb=False)
    md = Path(result["paths"]["markdown"]).read_text()
    assert "Answer quality through the .pte" in md
    qat = next(line for line in md.splitlines() if line.startswith("| chat-qat | qat | 4 |"))
    assert "| 0.500 [" in qat  # exact match 2 of 4, with its interval
    assert "answers/token_f1/pte" in Path(result["paths"]["csv"]).read_text().splitlines()[0]


@pytest.mark.fast
def test_held_out_conversations_are_the_records_inside_the_validation_split(tmp_path):
    from test_chat_data import chat_tokenizer, conversations, write_jsonl

    from qharness.data.datamodule import TextDataModule
    from qharness.sources.chat import render

    records = conversations(120)
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    tok = chat_tokenizer("chatml", " ".join(m["content"] for r in records for m in r["messages"]))
    dm = TextDataModule(source=path, seq_len=48, batch_size=2, val_fraction=0.2)
    dm.tokenizer = tok
    dm.setup()
    held = dm.conversations(None, 1000)
    lines = [int(where.rsplit(":", 1)[1]) for where, _ in held]
    assert lines == list(range(lines[0], 121)) and 10 < len(lines) < 40  # the last records, in order
    stream = dm.tokens_of(path, "text")[0].tolist()
    val_start = len(stream) - int(len(stream) * 0.2)
    ids = [min(len(render(tok, r["messages"], None, "all")[0]), 49) for r in records]
    starts = [sum(ids[:i]) for i in range(len(ids))]
    assert starts[lines[0] - 1] >= val_start > starts[lines[0] - 2]  # the one before starts in the training split
    assert dm.conversations(None, 3) == held[:3]


@pytest.mark.fast
def test_chat_settings_without_a_template_or_chat_records_fail_before_training(tmp_path, corpus):
    from test_chat_data import chat_tokenizer

    from qharness.data.datamodule import TextDataModule
    from qharness.evaluation.harness import check_chat_eval

    dm = TextDataModule(source=str(corpus), seq_len=64, batch_size=2)
    dm.tokenizer = chat_tokenizer("chatml")
    dm.tokenizer.chat_template = None  # a plain-text run whose tokenizer has no template
    check_chat_eval(EvalConfig(), dm)  # auto: off for plain text, no answers to give
    with pytest.raises(UserError, match=r"eval\.chat_template is on but the run has no chat template"):
        check_chat_eval(EvalConfig(chat_template=True), dm)
    with pytest.raises(UserError, match=r"eval\.answers\.source .* holds no chat or instruction records"):
        check_chat_eval(EvalConfig(answers={"source": str(corpus)}), dm)


@pytest.mark.fast
def test_the_python_api_evaluates_with_the_chat_template(tmp_path, corpus):
    from test_chat_data import make_tiny_chat_llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import qharness

    path = make_tiny_chat_llama(tmp_path / "model")
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    texts = [p for p in corpus.read_text()[:60_000].split("\n\n") if len(p) > 200]
    r = qharness.evaluate(model, tok, tasks=["qharness_mc"], texts=texts, limit=2, max_length=64, chat_template=True)
    assert r["chat_template"] == {"system_instruction": None, "fewshot_as_multiturn": True}
    assert "chat_template" not in qharness.evaluate(model, tok, tasks=["qharness_mc"], texts=texts, limit=2)
    tok.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        qharness.evaluate(model, tok, tasks=["qharness_mc"], texts=texts, limit=2, chat_template=True)
