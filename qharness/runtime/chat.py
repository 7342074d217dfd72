"""A conversation with a ``.pte``: the turns rendered with the chat template, the answer decoded until end-of-turn.

The conversation (``{"role", "content"}`` turns, the last a user turn) is rendered with the template and its
generation prompt and tokenized as training tokenized chat examples (``sources/chat.generation_prompt``), then
``generate.generate_ids`` decodes the answer until an EOS id of the ``.pte`` or an end-of-turn token of the template
(``sources/chat.end_of_turn_ids``: ``<|im_end|>``, ``<|eot_id|>``), ``max_new_tokens`` or the end of the KV cache.

When the rendered conversation leaves fewer than ``min(max_new_tokens, context // 2)`` positions of the KV cache for
the answer, the oldest exchanges are dropped (a user turn with the answers after it; system turns are kept) until it
does or only the last user turn is left; a last turn that alone fills the cache is refused in one line.

Example::

    out = chat_turn(PteModel("runs/x/model.pte"), load_tokenizer("runs/x/tokenizer"),
                    load_chat_tokenizer("runs/x/tokenizer"), [{"role": "user", "content": "Hi"}], temperature=0)
    print(out["text"], out["stopped"], out["dropped"])
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from qharness.errors import UserError
from qharness.runtime.generate import generate_ids, max_context
from qharness.sources.chat import ROLES, check_template, end_of_turn_ids, generation_prompt, load_template

OTHER_TEMPLATE = "pass a run that trained with a template (the run saves data.chat_template with its tokenizer)"


def load_chat_tokenizer(path: str | Path):
    """The transformers tokenizer of a run's ``tokenizer/`` directory (``tokenizer.json``, ``tokenizer_config.json``
    and ``chat_template.jinja``, as ``save_pretrained`` writes them): it renders the chat template."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001  a missing or malformed file: transformers raises many kinds
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(
            f"{path} holds no tokenizer transformers can load ({first})",
            fix="pass --tokenizer DIR: the run's tokenizer/ directory",
        ) from e


def chat_template(tokenizer, given: str | None) -> str | None:
    """The template to chat with: ``given`` (a file, the template text, or ``embedded``; None: the tokenizer's own),
    refused in one line when there is none or it does not render a user turn."""
    template = load_template(given, "--chat_template")
    check_template(tokenizer, template, "--chat_template", OTHER_TEMPLATE, "the conversation")
    generation_prompt(tokenizer, [{"role": "user", "content": "Hello"}], template)
    return template


def conversation(messages, system: str | None = None) -> list[dict]:
    """``messages`` checked (a text is one user turn): ``{"role", "content"}`` turns of the known roles, the last a
    user turn; ``system`` is put first when no turn is a system turn."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, list) or not messages:
        raise UserError("chat takes a non-empty list of turns", fix='pass [{"role": "user", "content": "..."}]')
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            raise UserError(
                f"messages[{i}] is not a turn ({turn!r:.80})",
                fix=f'give {{"role": one of {", ".join(ROLES)}, "content": text}}',
            )
    if messages[-1]["role"] != "user":
        raise UserError(
            f"the conversation ends with a {messages[-1]['role']} turn", fix="end it with the user turn to answer"
        )
    turns = [{"role": t["role"], "content": t["content"]} for t in messages]
    if system is not None and not any(t["role"] == "system" for t in turns):
        turns.insert(0, {"role": "system", "content": system})
    return turns


def fit_to_context(tokenizer, turns: list[dict], template: str | None, context: int, room: int):
    """``(ids, kept, dropped)``: the generation prompt of ``turns`` with the oldest exchanges dropped until ``room``
    positions of the ``context``-token cache are left for the answer (see the module's doc); ``kept``: the turns
    rendered, ``dropped``: how many were dropped."""
    kept = list(turns)
    ids = generation_prompt(tokenizer, kept, template)
    while len(ids) + room > context:
        first = next(i for i, t in enumerate(kept) if t["role"] != "system")
        later_user = [i for i in range(first + 1, len(kept)) if kept[i]["role"] == "user"]
        if not later_user:
            break  # only the last user turn is left
        kept = kept[:first] + kept[later_user[0] :]
        ids = generation_prompt(tokenizer, kept, template)
    if len(ids) >= context:
        raise UserError(
            f"the last user turn is {len(ids)} tokens with the chat template; the .pte's KV cache holds {context}",
            fix="send a shorter message, or export with a larger deploy.max_seq_len",
        )
    return ids, kept, len(turns) - len(kept)


def chat_turn(
    program,
    decoder,
    tokenizer,
    turns: list[dict],
    template: str | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    on_text: Callable[[str], None] = lambda s: None,
    cached: list[int] | None = None,
) -> dict:
    """The next assistant turn of ``turns`` (checked by ``conversation``): ``generate_ids``'s result with ``dropped``
    (turns dropped to fit the cache), ``conversation`` (the turns kept and the answer) and ``end_of_turn`` (the
    template's end-of-turn ids it stopped at). ``decoder``: the ``tokenizers.Tokenizer`` that decodes the answer;
    ``tokenizer``: the transformers one that renders the template."""
    context = max_context(program)
    ids, kept, dropped = fit_to_context(tokenizer, turns, template, context, min(max_new_tokens, context // 2))
    stop = end_of_turn_ids(tokenizer, template)
    out = generate_ids(
        program,
        decoder,
        ids,
        max_new_tokens,
        temperature,
        top_k,
        seed,
        on_text=on_text,
        stop_ids=set(stop),
        cached=cached,
    )
    out.update(dropped=dropped, end_of_turn=stop, conversation=[*kept, {"role": "assistant", "content": out["text"]}])
    return out
