"""Chatting with a ``.pte`` (``qharness generate --chat``, ``Pte.chat``): the chat template applied, the answer
streamed and stopped at the template's end-of-turn token (by our loop and by ExecuTorch's own runner in a fresh
process), multi-turn conversations from stdin with their history, the run's ``data.chat_template`` saved with its
tokenizer, and the one-line refusals.

The tiny chat models answer every user turn with the same two tokens and then the end-of-turn token: their scaled
embeddings dominate the residual stream and their untied output head maps each token of a chain (the generation
prompt's last token -> `` plus`` -> `` is`` -> end-of-turn) to the next, so a loop that does not stop at end-of-turn
goes on generating."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import run_cli, write_config
from test_chat_data import CHATML, LLAMA3, STYLES, chat_tokenizer, conversations, write_jsonl

from qharness.errors import UserError

ANSWER = " plus is"
QUESTIONS = ["What is 3 plus 4?", "And 5 times 2?", "What is 9 plus 1?", "And 8 times 2?"]
SYSTEM = "You are a calculator."


def chain_model(out, style: str, keep_template: bool = True):
    """A tiny Llama with a ``style`` chat tokenizer that answers ``ANSWER`` then the end-of-turn token (module doc);
    ``keep_template=False``: its tokenizer is saved without the template (the run gives it in data.chat_template)."""
    from conftest import tiny_spec

    from qharness.sources.chat import end_of_turn_ids
    from qharness.sources.embedded import new_llama

    tok = chat_tokenizer(style, " ".join(m["content"] for r in conversations(200) for m in r["messages"]))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    start = tok(prompt, add_special_tokens=False)["input_ids"][-1]
    chain = [start, *tok(ANSWER, add_special_tokens=False)["input_ids"], *end_of_turn_ids(tok)]
    assert len(chain) == len(set(chain)) == 4, chain
    torch.manual_seed(0)
    model = new_llama(tiny_spec(), 304)  # one config for both styles: the second run's architecture check is cached
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        embed.mul_(50)  # the embedding outweighs the random layers' contributions
        head = torch.randn_like(embed) * 0.3  # after end-of-turn: varied tokens (a zero head's argmax is EOS, id 0)
        for a, b in zip(chain, chain[1:]):
            head[b] = embed[a] / embed[a].norm() * 8
    model.lm_head.weight = torch.nn.Parameter(head)
    model.config.tie_word_embeddings = False
    model.save_pretrained(out)
    if not keep_template:
        tok.chat_template = None
    tok.save_pretrained(out)
    return out


def calibrate_chat_run(tmp, style: str, keep_template: bool):
    """``qharness calibrate`` (PTQ, xnnpack_int8_dynamic) of the chain model on conversations: its run directory."""
    model = chain_model(tmp / "model", style, keep_template)
    data = {"seq_len": 48, **({} if keep_template else {"chat_template": STYLES[style][0]})}
    path = write_jsonl(tmp / "chats.jsonl", conversations(200))
    cfg = write_config(
        tmp / "run.yaml", model, path, tmp / "run", model={"mode": "ptq"}, data=data, deploy={"max_seq_len": 160}
    )
    r = run_cli("calibrate", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run"


@pytest.fixture(scope="module")
def chatml_run(tmp_path_factory):
    """A chat run of a ChatML-style model whose tokenizer carries its template."""
    return calibrate_chat_run(tmp_path_factory.mktemp("chatml"), "chatml", keep_template=True)


@pytest.fixture(scope="module")
def llama3_run(tmp_path_factory):
    """A chat run of a Llama-3-style model whose tokenizer has no template: the run gives it (data.chat_template)."""
    return calibrate_chat_run(tmp_path_factory.mktemp("llama3"), "llama3", keep_template=False)


def prompt_tokens(run, turns) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run / "tokenizer")
    text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def stats(stderr: str) -> list[tuple[int, int]]:
    """``(prompt tokens, generated)`` of each answer's statistics line."""
    return [
        (int(a), int(b))
        for a, b in re.findall(r"\[(\d+) prompt tokens(?: \(\d+ prefilled\))?, (\d+) generated", stderr)
    ]


@pytest.mark.parametrize("which", ["chatml_run", pytest.param("llama3_run", marks=pytest.mark.slow)])  # one in default
def test_generate_chat_answers_one_turn_and_stops_at_end_of_turn(request, which):
    run = request.getfixturevalue(which)
    r = run_cli("generate", run, "--chat", "--prompt", QUESTIONS[0], "--temperature", "0", "--max_new_tokens", "20")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == ANSWER + "\n"
    turns = [{"role": "user", "content": QUESTIONS[0]}]
    assert stats(r.stderr) == [(prompt_tokens(run, turns), 2)]
    assert "[stopped: end of turn (or EOS)]" in r.stderr


@pytest.mark.slow  # a chat run of its own (~17 s); the default suite's chat fit (test_chat_data) is given its template by
# data.chat_template and checks that its run saves it
def test_the_run_saves_the_template_it_was_given_with_its_tokenizer(llama3_run, tmp_path):
    from transformers import AutoTokenizer

    assert (llama3_run / "tokenizer" / "chat_template.jinja").read_text() == LLAMA3
    assert AutoTokenizer.from_pretrained(llama3_run / "tokenizer").chat_template == LLAMA3


def test_chat_reads_turns_from_stdin_and_keeps_the_history(chatml_run):
    """Four turns through a 160-token cache: each prompt is the whole conversation so far (its tokens counted from the
    template here), the KV cache of the shared prefix is reused, and the fourth turn drops the oldest exchange."""
    r = subprocess.run(
        [sys.executable, "-m", "qharness", "generate", str(chatml_run), "--chat", "--system", SYSTEM,
         "--temperature", "0", "--max_new_tokens", "40"],
        input="\n".join(QUESTIONS) + "\n\nnot read: the empty line ended the conversation\n",
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == (ANSWER + "\n") * 4
    history, expected, drops = [{"role": "system", "content": SYSTEM}], [], []
    for i, q in enumerate(QUESTIONS):
        history.append({"role": "user", "content": q})
        if prompt_tokens(chatml_run, history) + min(40, 160 // 2) > 160:  # the rule: room for the answer
            del history[1:3]  # the oldest exchange goes, the system turn stays
            drops.append(i)
        expected.append((prompt_tokens(chatml_run, history), 2))
        history.append({"role": "assistant", "content": ANSWER})
    assert drops == [3] and stats(r.stderr) == expected
    assert r.stderr.count("[dropped the oldest 2 turns") == 1
    prefilled = [int(n) for n in re.findall(r"\((\d+) prefilled\)", r.stderr)]
    assert len(prefilled) == 3 and prefilled[0] < expected[1][0] - 30, r.stderr  # turn 2 reused turn 1's cache


def test_executorch_runner_stops_at_the_end_of_turn_in_a_fresh_process(chatml_run):
    """ExecuTorch's own ``TextLLMRunner`` on the chat run's ``.pte`` stops at ``<|im_end|>``: the ``.pte``'s EOS ids
    hold the template's end-of-turn token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chatml_run / "tokenizer")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[0]}], tokenize=False, add_generation_prompt=True
    )
    code = f"""
import json
import executorch.extension.llm.custom_ops.custom_ops
import executorch.kernels.quantized
from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

pieces, stats = [], []
runner = TextLLMRunner({str(chatml_run / "model.pte")!r}, {str(chatml_run / "tokenizer")!r})
config = GenerationConfig(echo=False, max_new_tokens=20, temperature=0.0, num_bos=0)
runner.generate({prompt!r}, config, token_callback=pieces.append, stats_callback=stats.append)
print("RESULT", json.dumps({{"pieces": pieces, "generated": stats[0].num_generated_tokens}}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.split("RESULT ", 1)[1])
    # the runner hands the end-of-turn token's text to the callback, then stops: two tokens generated, not 20
    assert result == {"pieces": [" plus", " is", "<|im_end|>"], "generated": 2}, result


def test_chat_refuses_a_tokenizer_without_template_and_a_template_that_does_not_render(chatml_run, tmp_path):
    import shutil

    bare = tmp_path / "tokenizer"
    shutil.copytree(chatml_run / "tokenizer", bare)
    (bare / "chat_template.jinja").unlink()
    r = run_cli("generate", chatml_run, "--chat", "--tokenizer", bare)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "error: the tokenizer has no chat template to render the conversation with. fix: give one in --chat_template "
        "(a Jinja file or string), or pass a run that trained with a template (the run saves data.chat_template with "
        "its tokenizer)"
    )
    r = run_cli("generate", chatml_run, "--chat", "--chat_template", "{{ messages | nofilter }}", "--prompt", "Hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "error: the chat template does not render the conversation" in last and "fix: give a template" in last


@pytest.mark.fast
def test_the_oldest_exchanges_go_first_and_the_system_turn_stays():
    from qharness.runtime.chat import conversation, fit_to_context
    from qharness.sources.chat import generation_prompt

    tok = chat_tokenizer("chatml")
    turns = conversation(
        [
            {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": QUESTIONS[1]},
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": QUESTIONS[2]},
        ],
        system="Answer briefly.",
    )
    whole = len(generation_prompt(tok, turns, None))
    ids, kept, dropped = fit_to_context(tok, turns, None, whole + 8, 8)
    assert (kept, dropped) == (turns, 0) and len(ids) == whole
    ids, kept, dropped = fit_to_context(tok, turns, None, whole + 7, 8)
    assert kept == [turns[0], *turns[3:]] and dropped == 2 and ids == generation_prompt(tok, kept, None)
    last = len(generation_prompt(tok, [turns[0], turns[-1]], None))
    ids, kept, dropped = fit_to_context(tok, turns, None, last + 3, 8)  # only the last user turn fits, less room
    assert kept == [turns[0], turns[-1]] and dropped == 4 and len(ids) == last
    with pytest.raises(UserError, match="the last user turn is .* tokens with the chat template; the .pte's KV cache"):
        fit_to_context(tok, turns, None, last, 8)
    with pytest.raises(UserError, match="the conversation ends with a assistant turn"):
        conversation(turns[:-1])


@pytest.mark.fast
def test_a_chatml_template_is_rendered_as_training_rendered_it():
    from qharness.sources.chat import generation_prompt, render

    tok = chat_tokenizer("chatml")
    turns = [{"role": "user", "content": QUESTIONS[0]}]
    ids, _ = render(tok, [*turns, {"role": "assistant", "content": "x"}], CHATML)
    head = generation_prompt(tok, turns, CHATML)
    assert ids[: len(head)] == head and tok.decode(head).endswith("<|im_start|>assistant\n")


def test_pte_chat_stops_at_the_templates_end_of_turn_even_when_the_pte_lacks_it(tmp_path):
    """``Pte.chat`` (what ``generate --chat`` calls) on a ``.pte`` whose EOS ids are the tokenizer's EOS alone (a model
    trained on text, then chatted with): the template's end-of-turn token still ends the answer; the plain loop, which
    stops at the ``.pte``'s EOS ids only, runs on past it."""
    import qharness
    from qharness.deploy.lower import lower_to_pte, quantize_for_deploy, runner_metadata
    from qharness.recipes.registry import load_recipe
    from qharness.sources.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(chain_model(tmp_path / "model", "llama3")))
    recipe = load_recipe("xnnpack_int8_dynamic")
    calibration = torch.randint(0, len(tok), (1, 16), generator=torch.Generator().manual_seed(0))
    graph = quantize_for_deploy(model, recipe, 96, lambda g: g(calibration, torch.tensor([0])))
    meta = runner_metadata(96, len(tok), tok.bos_token_id, [tok.eos_token_id])
    (tmp_path / "model.pte").write_bytes(lower_to_pte(graph, recipe, 96, meta))
    tok.save_pretrained(tmp_path / "tokenizer")
    pte = qharness.Pte.load(tmp_path)
    pieces = []
    assert pte.chat(QUESTIONS[0], max_new_tokens=20, on_token=pieces.append) == ANSWER == "".join(pieces)
    assert pte.last["stopped"] == "eos" and len(pte.last["new_tokens"]) == 2 and pte.last["dropped"] == 0
    assert pte.last["end_of_turn"] == [tok.convert_tokens_to_ids("<|eot_id|>")]
    turns = [*pte.last["conversation"], {"role": "user", "content": QUESTIONS[1]}]
    assert turns[1] == {"role": "assistant", "content": ANSWER}
    assert pte.chat(turns, max_new_tokens=20) == ANSWER and pte.last["prefilled_tokens"] < pte.last["prompt_tokens"]
    prompt = tok.apply_chat_template(turns[:1], tokenize=False, add_generation_prompt=True)
    pte.generate(prompt, max_new_tokens=6)
    assert len(pte.last["new_tokens"]) == 6 and pte.last["stopped"] == "max_new_tokens"
