"""Text generation from a ``.pte``: our own decode loop over ``executorch.runtime`` (``PteModel``).

The prompt is encoded with the ``tokenizer.json`` written beside the ``.pte`` (its post-processor adds
BOS, as in training), prefilled in one call, then tokens are sampled one at a time until an EOS id of
the ``.pte``'s metadata, ``max_new_tokens`` or the end of the KV cache. ``generate_ids`` does the same from token ids,
with extra stop ids (a chat template's end-of-turn tokens: ``chat.py``) and the KV cache of a previous call reused.

Example::

    out = generate(PteModel("runs/x/model.pte"), load_tokenizer("runs/x/tokenizer"), "To be", temperature=0)
    print(out["text"], out["prefill_tok_s"], out["decode_tok_s"])
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from qharness.config import check_generate_args
from qharness.errors import UserError


def load_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from a directory holding ``tokenizer.json`` (or the file itself)."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"no tokenizer at {file}", fix="pass --tokenizer DIR (the run's tokenizer/ directory)")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for malformed JSON or an unknown model type
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(
            f"{file} is not a tokenizer.json that tokenizers can read ({first})",
            fix="pass --tokenizer DIR holding the run's tokenizer.json (the tokenizer/ directory beside the .pte)",
        ) from e


def sample(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> int:
    """Next token from ``logits[vocab]``: argmax when ``temperature`` is 0, else softmax sampling of the top ``top_k`` (0: all)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=gen))


def generate(
    pte,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int = 0,
    seed: int | None = None,
    on_text: Callable[[str], None] = lambda s: None,
) -> dict:
    """Generate from ``prompt``; ``on_text`` receives each new piece of text as soon as it decodes cleanly."""
    return generate_ids(
        pte, tokenizer, tokenizer.encode(prompt).ids, max_new_tokens, temperature, top_k, seed, on_text=on_text
    )


def max_context(pte) -> int:
    """The ``.pte``'s KV cache length (``get_max_context_len``); a program without runner metadata is refused."""
    meta = pte.metadata()
    if "get_max_context_len" not in meta:
        raise UserError(
            f"{pte.path} carries no runner metadata (get_max_context_len)", fix="re-export it with qharness export"
        )
    return meta["get_max_context_len"]


def generate_ids(
    pte,
    tokenizer,
    ids: list[int],
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int = 0,
    seed: int | None = None,
    on_text: Callable[[str], None] = lambda s: None,
    stop_ids: frozenset[int] | set[int] = frozenset(),
    cached: list[int] | None = None,
) -> dict:
    """Generate after the token ids ``ids``, stopping at an EOS id of the ``.pte``'s metadata or one of ``stop_ids``
    (a chat template's end-of-turn tokens). ``cached``: the tokens whose keys and values the program's KV cache holds
    from the previous call on this ``pte`` (its ``"cached"``); only what follows their common prefix with ``ids`` is
    prefilled. The result's ``"cached"`` is what the cache holds afterwards."""
    check_generate_args(max_new_tokens, temperature, top_k, seed)
    context = max_context(pte)
    meta = pte.metadata()
    eos = set(meta.get("get_eos_ids", [])) | set(stop_ids)
    check_vocabulary(tokenizer, meta.get("get_vocab_size"), ids)
    if not 0 < len(ids) < context:
        raise UserError(
            f"the prompt is {len(ids)} tokens; the .pte's KV cache holds {context}",
            fix=f"give 1 to {context - 1} tokens",
        )
    reused = _common_prefix(cached or [], ids)
    reused = min(reused, len(ids) - 1)  # at least the last prompt token is fed: its logits choose the first token
    gen = torch.Generator()
    if seed is None:
        gen.seed()  # a fresh random seed (torch's default one is fixed)
    else:
        gen.manual_seed(seed)
    steps = min(max_new_tokens, context - len(ids))
    new, text, calls, stopped = [], "", 0, "max_new_tokens" if steps == max_new_tokens else "context"
    t0 = time.perf_counter()
    logits = pte(torch.tensor([ids[reused:]]), reused)[0, -1]
    t1 = time.perf_counter()
    fed = list(ids)
    for i in range(steps):
        token = sample(logits, temperature, top_k, gen)
        if token in eos:
            stopped = "eos"
            break
        new.append(token)
        decoded = tokenizer.decode(new)
        if not decoded.endswith("\ufffd"):  # hold back an incomplete UTF-8 sequence
            on_text(decoded[len(text) :])
            text = decoded
        if i + 1 < steps:
            logits = pte(torch.tensor([[token]]), len(ids) + i)[0, -1]
            fed.append(token)
            calls += 1
    t2 = time.perf_counter()
    final = tokenizer.decode(new)
    on_text(final[len(text) :])  # whatever was held back
    return {
        "text": final,
        "prompt_tokens": len(ids),
        "prefilled_tokens": len(ids) - reused,
        "new_tokens": new,
        "stopped": stopped,  # eos (an EOS or end-of-turn id), max_new_tokens, or context (the KV cache is full)
        "context": context,
        "cached": fed,
        "prefill_tok_s": (len(ids) - reused) / (t1 - t0),
        "decode_tok_s": calls / (t2 - t1) if calls else 0.0,
    }


def check_vocabulary(tokenizer, vocab: int | None, ids: list[int]) -> None:
    """The tokenizer belongs to the ``.pte``'s vocabulary of ``vocab`` ids (its metadata's ``get_vocab_size``): the
    prompt's ids all inside it, and the tokenizer's size near it (up to ``max(64, 1%)`` more tokens: a few added
    ones a model never resized for; up to ``max(4096, 5%)`` fewer: an embedding padded to a round size). Another
    model's tokenizer gives garbage, or an index error inside the runtime: refused in one line naming ``--tokenizer``."""
    if not isinstance(vocab, int) or vocab <= 0:
        return  # a program without the runner metadata: nothing to check against
    size = tokenizer.get_vocab_size(with_added_tokens=True) if hasattr(tokenizer, "get_vocab_size") else len(tokenizer)
    past = [i for i in ids if not 0 <= i < vocab]
    if past:
        what = f"encodes the prompt with id {past[0]}, past the .pte's vocabulary of {vocab}"
    elif size > vocab + max(64, vocab // 100) or size < vocab - max(4096, vocab // 20):
        what = f"has {size} tokens, the .pte's vocabulary {vocab}"
    else:
        return
    raise UserError(
        f"the tokenizer (--tokenizer) {what}: it is another model's tokenizer",
        fix="pass --tokenizer the tokenizer/ directory saved beside this .pte (or leave --tokenizer out)",
    )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
