"""Chat and instruction data (``data.format``): rendering with the chat template, the loss on the answers only,
packing without a loss across example boundaries, the token cache, bad records, and a QAT run on conversations."""

from __future__ import annotations

import json

import pytest
import torch

from qharness.data.datamodule import TextDataModule, pack
from qharness.errors import UserError
from qharness.sources.chat import ChatFormat, end_of_turn_ids, render, to_messages
from qharness.sources.example_cache import IGNORE, describe, example_stream

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_GENERATION = (  # the same rendering, its answers marked for return_assistant_tokens_mask
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
STYLES = {
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
}
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What does len return?"},
    {"role": "assistant", "content": "The number of items."},
    {"role": "user", "content": "And sorted?"},
    {"role": "assistant", "content": "A new sorted list."},
]


def chat_tokenizer(style: str, text: str = ""):
    """A tiny byte-level BPE with a chat template (``chatml``: ChatML/Qwen style; ``llama3``: Llama-3 style) and
    its special tokens, built offline."""
    from qharness.sources.tokenizer import train_bpe_tokenizer

    template, specials, _ = STYLES[style]
    tok = train_bpe_tokenizer([text or " ".join(m["content"] for m in CONVERSATION) * 20], 300)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    return tok


def conversations(n: int) -> list[dict]:
    """``n`` locally generated conversations (questions about numbers; one in three with a system turn, one in four
    with two rounds)."""
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "You are a calculator."}] if i % 3 == 0 else []
        turns += [
            {"role": "user", "content": f"What is {i} plus {i % 7}?"},
            {"role": "assistant", "content": f"{i} plus {i % 7} is {i + i % 7}."},
        ]
        if i % 4 == 0:
            turns += [
                {"role": "user", "content": f"And {i} times 2?"},
                {"role": "assistant", "content": f"It is {2 * i}."},
            ]
        out.append({"messages": turns})
    return out


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.fast
@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_loss_mask_covers_exactly_the_assistant_tokens(style):
    tok = chat_tokenizer(style)
    eot = STYLES[style][2]
    ids, trained = render(tok, CONVERSATION)
    assert tok.decode(ids) == tok.apply_chat_template(CONVERSATION, tokenize=False)
    answers = [m["content"] + eot for m in CONVERSATION if m["role"] == "assistant"]
    expected = [i for a in answers for i in tok(a, add_special_tokens=False)["input_ids"]]
    assert [i for i, t in zip(ids, trained) if t] == expected
    # the trained tokens are the answers' runs, contiguous, one per assistant turn
    runs = sum(1 for k, t in enumerate(trained) if t and (k == 0 or not trained[k - 1]))
    assert runs == 2
    assert end_of_turn_ids(tok) == [tok.convert_tokens_to_ids(eot)]
    all_ids, all_trained = render(tok, CONVERSATION, train_on="all")
    assert all_ids == ids and all(all_trained)


@pytest.mark.fast
def test_a_slow_tokenizer_gives_the_same_mask_piece_by_piece(monkeypatch):
    tok = chat_tokenizer("llama3")
    fast = render(tok, CONVERSATION)
    monkeypatch.setattr(type(tok), "is_fast", property(lambda self: False))
    assert render(tok, CONVERSATION) == fast


@pytest.mark.fast
def test_generation_markers_give_the_same_mask_as_prefix_renders(monkeypatch):
    import qharness.sources.chat as chat

    tok = chat_tokenizer("chatml")
    expected = render(tok, CONVERSATION)
    monkeypatch.setattr(chat, "answer_spans", None)  # a marked template is not rendered by prefixes
    assert render(tok, CONVERSATION, template=CHATML_GENERATION) == expected
    trimmed = CHATML_GENERATION.replace("{% generation %}", "{%- generation -%}")
    assert render(tok, CONVERSATION, template=trimmed) == expected


@pytest.mark.fast
def test_alpaca_and_prompt_completion_map_onto_the_same_rendering():
    tok = chat_tokenizer("chatml")
    fmt = ChatFormat(kind="instruction", max_tokens=100)
    alpaca = to_messages({"instruction": "Sort this.", "input": "3 1 2", "output": "1 2 3"}, "a:1", fmt)
    pair = to_messages({"prompt": "Sort this.\n\n3 1 2", "completion": "1 2 3"}, "b:1", fmt)
    chat = to_messages(
        {"messages": [{"role": "user", "content": "Sort this.\n\n3 1 2"}, {"role": "assistant", "content": "1 2 3"}]},
        "c:1",
        ChatFormat(kind="chat", max_tokens=100),
    )
    assert alpaca == pair == chat
    assert render(tok, alpaca) == render(tok, pair)
    custom = ChatFormat(kind="instruction", max_tokens=100, prompt_field="q", completion_field="a")
    assert to_messages({"q": "Sort this.\n\n3 1 2", "a": "1 2 3"}, "d:1", custom) == pair


@pytest.mark.fast
def test_packing_has_no_target_across_example_boundaries(tmp_path):
    tok = chat_tokenizer("chatml")
    records = conversations(5)
    path = write_jsonl(tmp_path / "c.jsonl", records)
    fmt = ChatFormat(kind="chat", max_tokens=1000, train_on="all")
    tokens, targets, counts = example_stream(path, fmt, tok)
    lengths = [len(render(tok, r["messages"])[0]) for r in records]
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    assert counts["examples"] == 5 and counts["tokens"] == len(tokens) == sum(lengths)
    masked = (targets == IGNORE).nonzero().flatten()
    assert torch.equal(masked, starts)  # train_on all: only each example's first token is no target
    assert counts["trained_tokens"] == len(tokens) - 5
    x, y = pack(tokens, 8, targets)
    for b in range(len(x)):
        for t in range(8):
            position = b * 8 + t + 1  # y[b, t] is the target of stream position b*8+t+1
            assert (y[b, t] == IGNORE) == bool((starts == position).any())
            assert y[b, t] in (IGNORE, tokens[position])
    # answers only: the targets are the answer tokens, the rest -100
    answers, answer_targets, answer_counts = example_stream(path, ChatFormat(kind="chat", max_tokens=1000), tok)
    assert torch.equal(answers, tokens)
    trained = [t for r in records for t, keep in zip(*render(tok, r["messages"])) if keep]
    assert answer_targets[answer_targets != IGNORE].tolist() == trained == answers[answer_targets != IGNORE].tolist()
    assert answer_counts["trained_tokens"] == len(trained)
    # both are cached: a second run (or DDP rank) maps them without rendering again
    from qharness.sources.token_cache import stats

    builds = stats["builds"]
    again, again_targets, _ = example_stream(path, fmt, tok)
    assert stats["builds"] == builds and torch.equal(again, tokens) and torch.equal(again_targets, targets)


@pytest.mark.fast
def test_long_examples_truncated_or_dropped(tmp_path):
    tok = chat_tokenizer("chatml")
    records = conversations(8)
    lengths = [len(render(tok, r["messages"])[0]) for r in records]
    limit = sorted(lengths)[4]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    tokens, _, counts = example_stream(path, ChatFormat(kind="chat", max_tokens=limit), tok)
    assert counts["truncated"] == sum(n > limit for n in lengths) > 0 and counts["examples"] == 8
    assert len(tokens) == sum(min(n, limit) for n in lengths)
    tokens, _, counts = example_stream(path, ChatFormat(kind="chat", max_tokens=limit, long_examples="drop"), tok)
    assert counts["dropped"] == sum(n > limit for n in lengths) and counts["examples"] == 8 - counts["dropped"]
    assert len(tokens) == sum(n for n in lengths if n <= limit)
    first = next(i for i, n in enumerate(lengths) if n > limit)
    line = describe(counts, ChatFormat(kind="chat", max_tokens=limit, long_examples="drop"))
    assert (
        f"{counts['dropped']} dropped (longer than {limit} tokens; {path}:{first + 1}: {lengths[first]} tokens)" in line
    )
    with pytest.raises(UserError, match=r"every record is longer than data.seq_len \+ 1 = 5 tokens .*c.jsonl:1"):
        example_stream(path, ChatFormat(kind="chat", max_tokens=5, long_examples="drop"), tok)


@pytest.mark.fast
def test_masked_targets_do_not_count_in_the_loss_or_the_scores():
    from qharness.checks.parity import score_batched, score_deployed
    from qharness.training.module import token_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    y = torch.randint(0, 11, (2, 6))
    masked = y.clone()
    masked[0, :3] = IGNORE
    masked[1, 4:] = IGNORE
    keep = masked != IGNORE
    ref = torch.nn.functional.cross_entropy(logits[keep], y[keep])
    assert torch.allclose(token_loss(logits, masked), ref)
    assert token_loss(logits, torch.full_like(y, IGNORE)).item() == 0.0  # not NaN: a block that is all prompt
    assert torch.allclose(token_loss(logits, y), torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
    x = torch.tensor([[0] * 6, [1] * 6])  # block i's logits are logits[i]
    batched = score_batched(lambda _: logits, x, masked, batch_size=2)
    deployed = score_deployed(lambda tokens, start: logits[int(tokens[0, 0])][None], x, masked)
    assert batched["loss"] == pytest.approx(ref.item(), rel=1e-6)
    assert len(batched["block_losses"]) == 2
    assert deployed["loss"] == pytest.approx(batched["loss"], rel=1e-6)
    none = masked.clone()
    none[1] = IGNORE
    assert len(score_batched(lambda _: logits, x, none, batch_size=2)["block_losses"]) == 1


@pytest.mark.fast
def test_distillation_matches_the_teacher_on_trained_positions_only():
    from qharness.training.module import distill_loss

    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 7), torch.randn(2, 5, 7)
    y = torch.randint(0, 7, (2, 5))
    assert distill_loss(student, teacher, 2.0, y) == distill_loss(student, teacher, 2.0)  # text: every position
    y[0, 1:] = IGNORE
    keep = y != IGNORE
    expected = distill_loss(student[keep], teacher[keep], 2.0)
    assert torch.allclose(distill_loss(student, teacher, 2.0, y), expected)
    assert distill_loss(student, teacher, 2.0, torch.full_like(y, IGNORE)).item() == 0.0


@pytest.mark.fast
def test_datamodule_detects_chat_and_keeps_text(tmp_path, tiny_llama):
    path = write_jsonl(tmp_path / "c.jsonl", conversations(60))
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    dm = TextDataModule(source=path, tokenizer=str(tiny_llama), seq_len=64, batch_size=2, chat_template=str(template))
    dm.setup()
    assert dm.format.kind == "chat" and dm.counts["examples"] == 60
    assert (dm.train_y == IGNORE).any() and (dm.train_y != IGNORE).any()
    assert torch.equal(dm.train_x.flatten()[1:], dm.tokens_of(path, "text")[0][1 : dm.train_x.numel()])
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": f"line {i} " * 20} for i in range(60)])
    plain = TextDataModule(source=text, tokenizer=str(tiny_llama), seq_len=16, batch_size=2)
    plain.setup()
    assert plain.format is None and not (plain.train_y == IGNORE).any()
    assert torch.equal(plain.val_tokens, torch.cat([plain.val_x.flatten(), plain.val_y[-1, -1:]]))  # lm-eval's text
    scored = dm.val_y.flatten() != IGNORE  # chat: the text unmasked, the targets its tokens where trained
    assert not (dm.val_tokens == IGNORE).any() and torch.equal(dm.val_tokens[1:][scored], dm.val_y.flatten()[scored])


@pytest.mark.fast
def test_a_split_without_an_answer_token_is_one_line_before_training(tmp_path, tiny_llama):
    """Conversations whose answers all lie beyond data.seq_len + 1 tokens (truncated away) at the end of the file: the
    validation split holds only prompt tokens, whose loss would read 0 and perplexity 1 for every model."""
    long = [{"messages": [{"role": "user", "content": "tell me " * 200}, {"role": "assistant", "content": "no."}]}] * 30
    path = write_jsonl(tmp_path / "c.jsonl", conversations(40) + long)
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    dm = TextDataModule(
        source=path, tokenizer=str(tiny_llama), seq_len=64, batch_size=2, val_fraction=0.3, chat_template=str(template)
    )
    with pytest.raises(UserError, match=r"the validation split's \d+ blocks hold no trained target"):
        dm.setup()


def _error(records, tmp_path, tok=None, **fmt) -> str:
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(UserError) as e:
        example_stream(path, ChatFormat(**{"kind": "chat", "max_tokens": 500, **fmt}), tok or chat_tokenizer("chatml"))
    return str(e.value)


@pytest.mark.fast
def test_bad_records_name_the_record_and_field(tmp_path):
    good = conversations(1)[0]
    user = {"role": "user", "content": "hi"}
    msg = _error([good, {"messages": [user, {"role": "bot", "content": "x"}]}], tmp_path)
    assert "bad.jsonl:2: messages[1] has the unknown role 'bot'" in msg and "fix: use one of system" in msg
    msg = _error([{"messages": [user, {"role": "assistant", "content": "  "}]}], tmp_path)
    assert "bad.jsonl:1: messages[1] is an empty assistant turn" in msg
    msg = _error([{"messages": [user]}], tmp_path)
    assert "bad.jsonl:1: 'messages' has no assistant turn" in msg
    msg = _error([{"prompt": "p"}], tmp_path, kind="instruction")
    assert "bad.jsonl:1 has no text 'completion' field (fields: prompt)" in msg
    broken = "{% for m in messages %}{{ m['content'] }}{{ raise_exception('no system turns') }}{% endfor %}"
    msg = _error([good], tmp_path, template=broken)
    assert "the chat template does not render" in msg and "bad.jsonl:1" in msg and "no system turns" in msg
    counted = "{{ messages | length }} turns\n" + CHATML  # a prefix renders differently from the whole
    msg = _error([good], tmp_path, template=counted)
    assert "bad.jsonl:1: the chat template renders the turns before messages[2] differently" in msg
    assert "data.train_on: all" in msg
    path = write_jsonl(tmp_path / "ok.jsonl", [good])
    fmt = ChatFormat(kind="chat", max_tokens=500, template=counted, train_on="all")
    assert example_stream(path, fmt, chat_tokenizer("chatml"))[2]["examples"] == 1  # the fix it names works
    tok = chat_tokenizer("chatml")
    tok.chat_template = None
    msg = _error([good], tmp_path, tok=tok)
    assert "the tokenizer has no chat template" in msg and "data.chat_template" in msg
    (tmp_path / "bad.jsonl").write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(UserError, match=r"bad.jsonl:2 is not valid JSON"):
        example_stream(str(tmp_path / "bad.jsonl"), ChatFormat(kind="chat", max_tokens=500), chat_tokenizer("chatml"))


@pytest.mark.fast
def test_bad_templates_and_sources_are_one_line(tmp_path, tiny_llama):
    from qharness.sources.chat import load_template

    with pytest.raises(UserError, match="data.chat_template 'chat.jinja' is neither a file nor a Jinja template"):
        load_template("chat.jinja")
    (tmp_path / "chat.jinja").write_text(CHATML)
    assert load_template(str(tmp_path / "chat.jinja")) == CHATML == load_template(CHATML)
    text = tmp_path / "notes.txt"
    text.write_text("plain text " * 100)
    dm = TextDataModule(source=str(text), tokenizer=str(tiny_llama), format="chat", chat_template=CHATML)
    with pytest.raises(UserError, match=r"notes.txt is not a .json/.jsonl .* file of chat or instruction records"):
        dm.setup()


def test_bad_records_through_the_cli(tmp_path, tiny_llama, corpus):
    from conftest import run_cli, write_config

    records = conversations(3)
    records[2]["messages"][1] = {"content": "no role here"}
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    cfg = write_config(tmp_path / "run.yaml", tiny_llama, path, tmp_path / "run", data={"chat_template": CHATML})
    result = run_cli("fit", "--config", cfg)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert f"error: {path}:3: messages[1] has no 'role'" in last and "fix:" in last
    assert "Traceback" not in result.stderr and "training" not in result.stderr.lower()


def make_tiny_chat_llama(out, style: str = "chatml"):
    """A random-init tiny Llama whose tokenizer carries a chat template and its special tokens."""
    from conftest import tiny_spec

    from qharness.sources.embedded import new_llama

    text = " ".join(m["content"] for r in conversations(200) for m in r["messages"])
    tok = chat_tokenizer(style, text)
    torch.manual_seed(0)
    new_llama(tiny_spec(), len(tok)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.slow
def test_qat_fit_on_an_alpaca_file_with_a_llama3_template(tmp_path):
    """The alpaca mapping and the Llama-3 template end to end (the fast tests check both in-process)."""
    from conftest import run_cli, write_config

    from qharness.runtime.pte import PteModel

    model = make_tiny_chat_llama(tmp_path / "model", "llama3")
    records = [
        {"instruction": f"Add {i} and {i % 7}.", "input": "" if i % 2 else "Show the sum.", "output": f"{i + i % 7}"}
        for i in range(300)
    ]
    path = write_jsonl(tmp_path / "alpaca.jsonl", records)
    cfg = write_config(tmp_path / "run.yaml", model, path, tmp_path / "run", data={"seq_len": 48})
    result = run_cli("fit", "--config", cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data: 300 instruction examples" in result.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["parity"]["passed"] is True
    from transformers import AutoTokenizer

    eot = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("<|eot_id|>")
    assert eot in PteModel(tmp_path / "run" / "model.pte").metadata()["get_eos_ids"]


def test_qat_fit_on_conversations_exports_a_pte_that_stops_at_end_of_turn(tmp_path):
    from conftest import run_cli, write_config
    from transformers import AutoTokenizer

    from qharness.runtime.pte import PteModel

    model = make_tiny_chat_llama(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(model)
    template = tok.chat_template  # given by the config instead: the tokenizer leaves it out
    (model / "chat_template.jinja").unlink(missing_ok=True)
    tok.chat_template = None
    tok.save_pretrained(model)
    assert AutoTokenizer.from_pretrained(model).chat_template is None
    path = write_jsonl(tmp_path / "chats.jsonl", conversations(200))
    data = {"seq_len": 48, "chat_template": template}
    cfg = write_config(tmp_path / "run.yaml", model, path, tmp_path / "run", data=data)
    result = run_cli("fit", "--config", cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data: 200 chat examples" in result.stderr and "trained (answers)" in result.stderr
    assert "truncated to their first 49 tokens" in result.stderr  # two-round conversations exceed seq_len + 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["parity"]["passed"] is True
    # the run's tokenizer carries the template it was given, for generate --chat and the runner
    assert (tmp_path / "run" / "tokenizer" / "chat_template.jinja").read_text() == template
    assert AutoTokenizer.from_pretrained(tmp_path / "run" / "tokenizer").chat_template == template
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert eot in PteModel(tmp_path / "run" / "model.pte").metadata()["get_eos_ids"]


@pytest.mark.fast
def test_embedded_chat_is_an_offline_instruction_dataset_with_its_template(tmp_path):
    from qharness.sources.chat_demo import EMBEDDED_CHAT, TEMPLATE, embedded_chat_file, embedded_instructions
    from qharness.sources.tokenizer import EOS, train_bpe_tokenizer

    records = embedded_instructions()
    assert len(records) > 200 and records == embedded_instructions()  # deterministic
    assert all(r["prompt"].strip() and r["completion"].strip() for r in records)
    path = embedded_chat_file()
    assert path == embedded_chat_file() and [json.loads(line) for line in path.read_text().splitlines()] == records
    tok = train_bpe_tokenizer([" ".join(r["prompt"] + " " + r["completion"] for r in records[:50])], 300)
    dm = TextDataModule(source=EMBEDDED_CHAT, chat_template="embedded", seq_len=64, batch_size=2)
    dm.tokenizer = tok
    tokens, targets = dm.tokens_of(EMBEDDED_CHAT, "text")
    assert dm.format.kind == "instruction" and dm.format.template == TEMPLATE
    assert dm.counts["examples"] == len(records)
    first = to_messages(records[0], "r", dm.format)
    ids, trained = render(tok, first, TEMPLATE)
    assert tok.decode([i for i, t in zip(ids, trained) if t]) == records[0]["completion"] + EOS
    assert end_of_turn_ids(tok, TEMPLATE) == [tok.eos_token_id]  # the runner stops at an answer's EOS


@pytest.mark.fast
@pytest.mark.parametrize(
    "template, what",
    [
        ("{% for m in messages %}{{ m.content * 10000000 }}{% endfor %}", "repeated 10,000,000 times"),
        ("{{ 'x' * 10**9 }}", "repeated"),
        (
            "{% for i in range(90000) %}{% for j in range(90000) %}{{ messages[0].content }}{% endfor %}{% endfor %}",
            "its rendered text",
        ),
        ("{{ 7 ** 100000000 }}", "bits"),
        ("{{ messages[0].content | center(10**9) }}", "center"),
    ],
)
def test_a_chat_template_of_huge_output_is_one_line_before_the_allocation(template, what):
    """Training data and generate --chat render through sources/chat.py: the bound holds for both."""
    from qharness.sources.chat import generation_prompt

    tok = chat_tokenizer("chatml")
    turn = [{"role": "user", "content": "hello there"}]
    with pytest.raises(UserError, match=f"the chat template does not render .*SecurityError.*{what}") as e:
        render(tok, [*turn, {"role": "assistant", "content": "hi"}], template=template)
    assert "data.chat_template" in str(e.value)
    with pytest.raises(UserError, match="exceed 10,000,000 characters") as e:
        generation_prompt(tok, turn, template, "--chat_template")
    assert "--chat_template" in str(e.value)
    ok = "{% for m in messages %}{{ m.content * 3 }}{{ 2 ** 10 }}{% endfor %}"  # small ones still render
    assert generation_prompt(tok, turn, ok, "--chat_template")
