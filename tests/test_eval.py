"""lm-eval adapters against references computed directly, the offline tasks, and ``qharness evaluate``."""

from __future__ import annotations

import json
import math
import re
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import copy_of_fitted, run_cli


@pytest.fixture(scope="module")
def fp(tiny_llama):
    from qharness.sources.models import load_model_and_tokenizer

    return load_model_and_tokenizer(str(tiny_llama))


def _req(*args):
    return SimpleNamespace(args=args)


def _direct_loglikelihood(model, ids: list[int], n_cont: int) -> float:
    """log p(last n_cont tokens | the ones before) from one plain forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0]
    logp = F.log_softmax(logits.float(), -1)
    return sum(logp[i - 1, ids[i]].item() for i in range(len(ids) - n_cont, len(ids)))


def _adapters(model, tok, max_length=64):
    from qharness.deploy.fastpath.decoder import FastDecoder
    from qharness.evaluation.lm_eval_adapter import BatchedForward, CachedStep, QHarnessLM, hf_backend
    from qharness.training.prepare import export_for_training

    graph = export_for_training(model, 3, max_length)  # a fixed [3, T] graph, like the fake-quant one
    decoder = FastDecoder(model, max_length + 1)  # what the .pte runs: a KV cache, last-token logits only
    return {
        "hf": QHarnessLM(hf_backend(model, max_length, batch_size=2), tok),
        "fixed_shape_graph": QHarnessLM(BatchedForward(graph, max_length, 3, shape=(3, max_length)), tok),
        "kv_cache_last_token": QHarnessLM(
            CachedStep(lambda tokens, start: decoder(tokens, torch.tensor([start])), max_length), tok
        ),
    }


@pytest.mark.fast
def test_loglikelihood_equals_log_softmax_of_a_direct_forward(fp):
    model, tok = fp
    long_ctx = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 3
    pairs = [
        ("First Citizen:\nBefore we proceed", " any further, hear me speak."),
        ("All:\nSpeak,", " speak."),
        ("", "You are all resolved"),
        (long_ctx.rstrip(), "\nFirst Citizen:"),
    ]
    L = 32
    for name, lm in _adapters(model, tok, L).items():
        got = lm.loglikelihood([_req(*p) for p in pairs])
        for (ctx, cont), (score, greedy) in zip(pairs, got):
            ctx_ids = tok(ctx, add_special_tokens=False)["input_ids"] if ctx else [tok.bos_token_id]
            whole = (
                tok(ctx + cont, add_special_tokens=False)["input_ids"]
                if ctx
                else ctx_ids + tok(cont, add_special_tokens=False)["input_ids"]
            )
            # the model sees the last L tokens (the long context is cut on the left)
            ref = _direct_loglikelihood(model, whole[-(L + 1) :], len(whole) - len(ctx_ids))
            assert score == pytest.approx(ref, abs=1e-3), name
            assert isinstance(greedy, bool)
        # lm-eval's convention: a context's trailing space belongs to the continuation
        assert lm.loglikelihood([_req("All:\nSpeak, ", "speak.")])[0][0] == pytest.approx(got[1][0], abs=1e-4)


@pytest.mark.fast
def test_rolling_loglikelihood_matches_a_direct_window_by_window_computation(fp, corpus):
    model, tok = fp
    text = corpus.read_text()[5000:5600]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    L = 24
    assert len(ids) > 3 * L
    # Tokens are predicted in disjoint runs of L, each from the L tokens before its end (the first run from BOS;
    # the last, shorter run with earlier text as extra context), as lm-eval's rolling windows define it.
    full = [tok.bos_token_id, *ids]
    ref = 0.0
    for s in range(0, len(ids), L):
        e = min(s + L, len(ids))
        ref += _direct_loglikelihood(model, full[max(0, e - L) : e + 1], e - s)
    for name, lm in _adapters(model, tok, L).items():
        (got,) = lm.loglikelihood_rolling([_req(text)])
        assert got == pytest.approx(ref, rel=1e-4), name


def test_generate_until_greedy_stop_sequences_and_seeded_sampling(fp):
    model, tok = fp
    prompt = "KING RICHARD III:\nNow is the winter of"
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    direct = list(ids)
    with torch.no_grad():
        for _ in range(10):
            direct.append(int(model(input_ids=torch.tensor([direct])).logits[0, -1].argmax()))
    direct_text = tok.decode(direct[len(ids) :], skip_special_tokens=True)
    for name, lm in _adapters(model, tok).items():
        (greedy,) = lm.generate_until([_req(prompt, {"until": [], "max_gen_toks": 10, "do_sample": False})])
        assert greedy == direct_text, name
        stop = direct_text[4:6]
        (cut,) = lm.generate_until([_req(prompt, {"until": [stop], "max_gen_toks": 10})])
        assert cut == direct_text.split(stop)[0], name
    lm = _adapters(model, tok)["hf"]
    sampled = {"until": [], "max_gen_toks": 12, "do_sample": True, "temperature": 1.5, "top_k": 50}
    runs = []
    for _ in range(2):
        lm.generator.manual_seed(7)
        runs.append(lm.generate_until([_req(prompt, sampled), _req("To be", sampled)]))
    assert runs[0] == runs[1]
    (greedy12,) = lm.generate_until([_req(prompt, {**sampled, "do_sample": False})])
    assert runs[0][0] != greedy12  # temperature 1.5 over a random model: sampling leaves the greedy path


@pytest.mark.fast
def test_offline_documents_are_deterministic_and_well_formed(corpus, tmp_path):
    from qharness.evaluation.tasks import build_documents, write_offline_tasks

    text = corpus.read_text()[-60_000:]
    docs = build_documents([text], seed=3)
    assert docs == build_documents([text], seed=3)
    assert len(docs["qharness_ppl"]) >= 8 and all(len(d["text"]) <= 2000 for d in docs["qharness_ppl"])
    for d in docs["qharness_mc"]:
        assert len(d["choices"]) == 4 and len(set(d["choices"])) == 4
        gold = d["choices"][d["label"]]
        assert d["context"] + gold in text  # the right answer is the text's real next line
    for d in docs["qharness_gen"]:
        assert d["context"] + d["target"] + "\n" in text
    out = write_offline_tasks([text], tmp_path / "tasks")
    for name in ("qharness_ppl", "qharness_mc", "qharness_gen"):
        cfg = yaml.safe_load((out / f"{name}.yaml").read_text())
        assert cfg["task"] == name and (out / "data" / f"{name}.jsonl").is_file()


@pytest.mark.fast
def test_offline_tasks_run_through_lm_eval(fp, corpus, tmp_path):
    from qharness.config import EvalConfig
    from qharness.evaluation.harness import format_eval_table, run_eval
    from qharness.evaluation.lm_eval_adapter import QHarnessLM, hf_backend

    model, tok = fp
    result = run_eval(
        {"fp": QHarnessLM(hf_backend(model, 32, 4), tok)},
        EvalConfig(tasks=["qharness_ppl", "qharness_mc", "qharness_gen"], limit=3, bootstrap_iters=0),
        [corpus.read_text()[-40_000:]],
        tmp_path,
        {"max_length": 32},
    )
    metrics = result["tasks"]
    assert set(metrics) == {"qharness_ppl", "qharness_mc", "qharness_gen"}
    assert metrics["qharness_ppl"]["fp"]["bits_per_byte"] > 0 and math.isfinite(
        metrics["qharness_ppl"]["fp"]["word_perplexity"]
    )
    assert 0.0 <= metrics["qharness_mc"]["fp"]["acc_mutual_info"] <= 1.0
    assert 0.0 <= metrics["qharness_gen"]["fp"]["chrf"] <= 100.0
    assert result["documents"] == {"qharness_ppl": 3, "qharness_mc": 3, "qharness_gen": 3}
    # what guessing scores: 1 of 4 lines; a uniform byte model; nothing stated for generation
    assert result["chance"]["qharness_mc"] == {"acc_mutual_info": 0.25}
    assert result["chance"]["qharness_ppl"] == {"byte_perplexity": 256.0, "bits_per_byte": 8.0}
    assert "qharness_gen" not in result["chance"]
    assert re.search(r"qharness_mc\s+acc_mutual_info\s+0\.2500\s", format_eval_table(result))
    assert json.loads((tmp_path / "eval.json").read_text())["tasks"] == json.loads(json.dumps(metrics))
    assert "qharness_mc" in format_eval_table(result)
    from lm_eval.api.registry import get_model

    from qharness.evaluation.lm_eval_adapter import RegisteredQHarnessLM

    assert get_model("qharness") is RegisteredQHarnessLM  # lm-eval's registry knows the adapter


def test_fit_ends_with_the_three_way_table(fitted):
    run_dir, _cfg, result = fitted
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    ev = summary["eval"]
    assert ev["models"] == ["fp", "fake_quant", "pte"]
    for task in ("qharness_ppl", "qharness_mc", "qharness_gen"):
        assert set(ev["tasks"][task]) == {"fp", "fake_quant", "pte"}
    assert re.search(r"qharness_ppl\s+word_perplexity", result.stdout)
    fq, pte = ev["tasks"]["qharness_ppl"]["fake_quant"], ev["tasks"]["qharness_ppl"]["pte"]
    assert pte["word_perplexity"] == pytest.approx(fq["word_perplexity"], rel=0.02)  # parity tolerance


def test_evaluate_pte_perplexity_matches_a_direct_runtime_computation(fitted, tmp_path):
    from transformers import AutoTokenizer

    from qharness.runtime.pte import PteModel

    off = {"enabled": False}
    run_dir, cfg = copy_of_fitted(
        fitted, tmp_path, eval=off, bench=off, wandb=off
    )  # a copy: evaluate adds to summary.json, which other tests read
    own_eval = (run_dir / "eval.json").read_text()
    r = run_cli("evaluate", cfg, "--tasks", "qharness_ppl", "--limit", "2", "--models", "converted,pte")
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"word_perplexity\s+\S+\s+\S+", r.stdout)
    summary = json.loads((run_dir / "summary.json").read_text())
    # nothing the fit wrote is lost (#23): its eval.json and summary eval stay, the new table is added beside them
    assert (run_dir / "eval.json").read_text() == own_eval
    assert summary["eval"] == json.loads(own_eval)
    ev = json.loads((run_dir / summary["evaluations"][-1]["file"]).read_text())
    report = run_cli("report", run_dir, "--no_wandb")
    assert report.returncode == 0, report.stderr[-3000:]
    header = (run_dir / "report.csv").read_text().splitlines()[0]
    assert (
        "eval/qharness_mc/acc_mutual_info/pte" in header and "eval/qharness_ppl/word_perplexity/converted" in header
    )  # both tables
    evaluation = summary["evaluations"][-1]
    assert evaluation["pte_sha256"] == summary["pte"]["sha256"]  # which program it scored
    L = ev["max_length"]
    docs = [
        json.loads(line)["text"]
        for line in (run_dir / "eval" / "tasks" / "data" / "qharness_ppl.jsonl").read_text().splitlines()[:2]
    ]
    tok = AutoTokenizer.from_pretrained(run_dir / "tokenizer")
    pte = PteModel(run_dir / "model.pte")
    total, words = 0.0, 0
    for text in docs:
        full = [tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"]]
        n = len(full) - 1
        for s in range(0, n, L):  # runs of L predicted tokens, each from the L tokens before its end
            e = min(s + L, n)
            window = full[max(0, e - L) : e + 1]
            # one token per call through the KV cache: the .pte returns the last position's logits
            rows = [pte(torch.tensor([[t]]), i)[0, -1] for i, t in enumerate(window[:-1])]
            logp = F.log_softmax(torch.stack(rows).float(), -1)
            targets = torch.tensor(window[1:])
            total += logp[torch.arange(len(targets)), targets][-(e - s) :].sum().item()
        words += len(re.split(r"\s+", text))
    got = ev["tasks"]["qharness_ppl"]
    assert got["pte"]["word_perplexity"] == pytest.approx(math.exp(-total / words), rel=1e-4)
    assert got["pte"]["word_perplexity"] == pytest.approx(got["converted"]["word_perplexity"], rel=0.02)


@pytest.mark.slow  # ~30 s (an evaluate and a deploy); the default suite evaluates the run above and reads back
# earlier evaluations of a summary in process (test_a_new_summary_keeps_the_evaluations_of_the_one_it_replaces)
def test_a_re_export_keeps_the_evaluations(fitted, tmp_path):
    off = {"enabled": False}
    run_dir, cfg = copy_of_fitted(fitted, tmp_path, eval=off, bench=off, wandb=off)
    r = run_cli("evaluate", cfg, "--tasks", "qharness_ppl", "--limit", "2", "--models", "pte")
    assert r.returncode == 0, r.stderr[-3000:]
    evaluation = json.loads((run_dir / "summary.json").read_text())["evaluations"][-1]
    again = run_cli("export", cfg)  # a re-export writes a new summary.json ...
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["evaluations"] == [evaluation]  # ... and keeps them


@pytest.mark.fast
def test_a_new_summary_keeps_the_evaluations_of_the_one_it_replaces(tmp_path):
    from qharness.run.results import earlier_evaluations
    from qharness.run.summary import RunSummary

    path = tmp_path / "summary.json"
    assert earlier_evaluations(path) == []  # no summary yet
    evaluations = [{"file": "eval-1.json", "pte_sha256": "ab" * 32, "tasks": {"qharness_ppl": {}}}]
    summary = RunSummary(run_dir=str(tmp_path), model="m", recipe="r", backend="xnnpack", mode="ptq", quantized=True,
                         seq_len=16, eval_blocks=1, evaluations=evaluations)  # fmt: skip
    path.write_text(json.dumps(summary.to_dict()))
    assert earlier_evaluations(path) == evaluations
    path.write_text("{ not json")
    assert earlier_evaluations(path) == []  # an unreadable summary is replaced; its evaluations' files stay beside it


def test_standard_task_offline_fails_fast_with_how_to_provide_the_data(fitted):
    _run_dir, cfg, _ = fitted
    start = time.perf_counter()
    r = run_cli("evaluate", cfg, "--tasks", "wikitext")
    elapsed = time.perf_counter() - start
    assert r.returncode == 2
    assert "wikitext" in r.stderr and "cannot be reached" in r.stderr and "eval.source" in r.stderr
    assert "Traceback" not in r.stderr
    print(f"offline wikitext refused in {elapsed:.1f} s")


@pytest.mark.fast
def test_own_task_yaml_through_include_path(fp, tmp_path):
    from qharness.config import EvalConfig
    from qharness.evaluation.harness import run_eval
    from qharness.evaluation.lm_eval_adapter import QHarnessLM, hf_backend
    from qharness.evaluation.tasks import TEMPLATES, check_tasks

    model, tok = fp
    (tmp_path / "mine").mkdir()
    data = tmp_path / "mine" / "docs.jsonl"
    data.write_text(json.dumps({"text": "To be, or not to be, that is the question."}) + "\n")
    cfg = yaml.safe_load((TEMPLATES / "qharness_ppl.yaml").read_text())
    cfg.update(task="my_ppl", dataset_kwargs={"data_files": {"test": str(data)}})
    (tmp_path / "mine" / "my_ppl.yaml").write_text(yaml.safe_dump(cfg))
    check_tasks(["my_ppl"], str(tmp_path / "mine"))
    result = run_eval(
        {"fp": QHarnessLM(hf_backend(model, 32, 4), tok)},
        EvalConfig(tasks=["my_ppl"], include_path=str(tmp_path / "mine"), bootstrap_iters=0),
        [],
        tmp_path / "run",
    )
    (ll,) = QHarnessLM(hf_backend(model, 32, 4), tok).loglikelihood_rolling(
        [_req("To be, or not to be, that is the question.")]
    )
    assert result["tasks"]["my_ppl"]["fp"]["word_perplexity"] == pytest.approx(math.exp(-ll / 10), rel=1e-6)


@pytest.mark.fast
def test_lm_eval_standard_errors_reach_the_summary_row_and_the_tables(fp, corpus, tmp_path):
    from qharness.config import EvalConfig
    from qharness.evaluation.harness import format_eval_table, run_eval
    from qharness.evaluation.lm_eval_adapter import QHarnessLM, hf_backend
    from qharness.reporting.rows import summary_row

    model, tok = fp
    cfg = EvalConfig(
        tasks=["qharness_mc"], limit=6, bootstrap_iters=10
    )  # a mean's stderr is closed-form (no bootstrap pool)
    result = run_eval(
        {"fp": QHarnessLM(hf_backend(model, 32, 4), tok)},
        cfg,
        [corpus.read_text()[-40_000:]],
        tmp_path,
        {"max_length": 32},
    )
    mc = result["tasks"]["qharness_mc"]["fp"]
    n, acc = 6, mc["acc_mutual_info"]
    assert mc["acc_mutual_info_stderr"] == pytest.approx(
        math.sqrt(acc * (1 - acc) * n / (n - 1) / n)
    )  # sample sd of 0/1 scores / sqrt(n)
    saved = json.loads((tmp_path / "eval.json").read_text())["tasks"]["qharness_mc"]["fp"]
    assert saved["acc_mutual_info_stderr"] == mc["acc_mutual_info_stderr"]
    assert f"{acc:.4f} ± {mc['acc_mutual_info_stderr']:.4f}" in format_eval_table(result)
    from qharness.run.summary import RunSummary

    blank = dict(run_dir="x", model="m", recipe="xnnpack_fp32", backend="xnnpack", seq_len=16, eval_blocks=4)
    row = summary_row(RunSummary(**blank, mode="ptq", quantized=False, eval=result))
    assert row["eval/qharness_mc/acc_mutual_info/fp"] == acc
    assert row["eval/qharness_mc/acc_mutual_info_stderr/fp"] == mc["acc_mutual_info_stderr"]
    from qharness.reporting.render import eval_header

    assert eval_header([row], "eval/qharness_mc/acc_mutual_info/fp") == "qharness_mc/acc_mutual_info/fp (chance 0.25)"
    assert eval_header([row], "eval/qharness_mc/acc_mutual_info/pte") == "qharness_mc/acc_mutual_info (chance 0.25)"
    assert eval_header([row], "eval/qharness_ppl/word_perplexity/pte") == "qharness_ppl/word_perplexity"  # none stated


@pytest.mark.fast
def test_eval_table_shows_standard_errors_of_filtered_metrics():
    from qharness.evaluation.harness import format_eval_table

    result = {
        "models": ["fp", "pte"],
        "max_length": 32,
        "documents": {"t": 5},
        "tasks": {
            "t": {
                "fp": {"exact_match,strict": 0.4, "exact_match_stderr,strict": 0.2, "acc": 0.5, "acc_stderr": None},
                "pte": {"exact_match,strict": 0.2, "exact_match_stderr,strict": 0.1, "acc": 0.25, "acc_stderr": None},
            }
        },
    }
    lines = format_eval_table(result).splitlines()
    assert [line.split()[:2] for line in lines[2:]] == [
        ["t", "exact_match,strict"],
        ["acc", "-"],
    ]  # no stderr rows; no chance level given: "-"
    assert "0.4000 ± 0.2000" in lines[2] and "0.2000 ± 0.1000" in lines[2]
    assert lines[3].split() == ["acc", "-", "0.5000", "0.2500"]  # lm-eval gave no stderr ("N/A"): the value alone


@pytest.mark.fast
def test_documents_stored_one_per_line_give_every_offline_task_documents(corpus, tmp_path):
    """Parquet/JSONL rows are often one long line each: wrapped into lines, they give the three offline tasks their
    documents (they failed the run after a passing deploy with 'too small'); short lines stay as they are."""
    from qharness.evaluation.tasks import build_documents, write_offline_tasks

    prose = " ".join(corpus.read_text()[:80_000].split())  # the same words, no line ends
    rows = [prose[i : i + 3000] for i in range(0, len(prose), 3000)]
    docs = build_documents(rows, seed=1)
    assert all(docs[name] for name in ("qharness_ppl", "qharness_mc", "qharness_gen")), {
        k: len(v) for k, v in docs.items()
    }
    assert all(len(c) <= 120 for d in docs["qharness_mc"] for c in d["choices"])
    write_offline_tasks(rows, tmp_path / "tasks")
    text = corpus.read_text()[-20_000:]
    assert build_documents([text], seed=3) == build_documents([text], seed=3)  # deterministic as before


@pytest.mark.fast
def test_evaluation_text_without_usable_lines_names_the_task_and_what_it_needs(tmp_path):
    from qharness.errors import UserError
    from qharness.evaluation.tasks import write_offline_tasks

    words = ["short line\n" * 400]
    with pytest.raises(UserError, match=r"gives qharness_mc no documents: it needs lines of 16-120 characters"):
        write_offline_tasks(words, tmp_path / "tasks", tasks=["qharness_mc"], where="eval.source x.txt")
    write_offline_tasks(words, tmp_path / "tasks", tasks=["qharness_ppl"])  # the task asked for has documents
    assert not (tmp_path / "tasks" / "qharness_mc.yaml").exists()
