"""The FP model's own samples (``data.source: generated``; what they are: ``generated.py``) -> a token stream and its
targets, sampled once and cached.

Sampling is transformers' ``generate`` (KV cache, batches of ``BATCH``, ``top_k`` off, ``top_p`` =
``data.generated_top_p``: 1.0 is the model's whole distribution), seeded by ``data.seed``, on the GPU when there is
one, with a progress bar. The checkpoint's own ``generation_config`` (its repetition penalty, temperature, ...) is
not used: the samples follow the model's distribution itself.

The samples are cached under ``$QHARNESS_CACHE/generated/<key>.npz`` (numpy arrays, read back with
``allow_pickle=False``; written atomically under a lock, so DDP ranks and later runs reuse them), the key hashing the
model's files (``config.json``'s content, each weight file's path, size and mtime; its id for a hub model), the
tokenizer, the template, the prompts, the sampling settings, the seed and the device kind (a GPU samples other tokens
than the CPU from one seed).

As a token source the samples are one stream like text documents: each sample followed by EOS where it did not end
with it (an appended EOS is not trained), the targets -100 on each sample's prompt (its first token in text mode,
the templated user turn in chat mode), so nothing is trained across samples.

Example::

    tokens, targets, counts = generated_stream("embedded", tokenizer, GenerateSpec(128, 129), chat=False)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from qharness.errors import UserError
from qharness.io.atomic import atomic_writer
from qharness.io.locks import hold_lock
from qharness.progress import bar
from qharness.sources.cache import cache_dir
from qharness.sources.chat import end_of_turn_ids, generation_prompt
from qharness.sources.generated import GENERATED, GREEDY_TOKENS, PROMPTS, GenerateSpec
from qharness.sources.models import load_model_and_tokenizer, resolve_checkpoint
from qharness.sources.token_cache import tokenizer_fingerprint

BATCH = 16  # samples generated at once
FORMAT = 1  # of the cached samples (part of the key)
IGNORE = -100  # an untrained target (``example_cache.IGNORE``)

stats = {"builds": 0}  # this process's sample generations (tests read it)


@dataclass
class Samples:
    """The samples: ``tokens[i]`` (the ids of sample ``i``, its prompt first) and ``prompt_lengths[i]``; ``chat``:
    answers to templated prompts (else LLM-QAT text); ``ended``: how many ended with the model's own end token."""

    tokens: list[list[int]]
    prompt_lengths: list[int]
    chat: bool
    ended: int


def generated_samples(
    checkpoint: str,
    tokenizer,
    spec: GenerateSpec,
    chat: bool,
    template: str | None = None,
    trust_remote_code: bool = False,
    field: str = "data.source",
) -> Samples:
    """The samples of ``checkpoint``'s FP model (a ``model.checkpoint`` value), from the cache (sampled on first use);
    ``chat``: answers to ``PROMPTS`` rendered with ``template`` (None: the tokenizer's chat template), else LLM-QAT
    text."""
    resolved = resolve_checkpoint(checkpoint)
    root = cache_dir() / "generated"
    root.mkdir(parents=True, exist_ok=True)
    key = sample_key(resolved, tokenizer, spec, chat, template)
    path = root / f"{key}.npz"
    if not path.is_file():
        with hold_lock(root / f"{key}.lock", f"sampling {field} {GENERATED} from {checkpoint}"):
            if not path.is_file():
                _save(path, _generate(resolved, tokenizer, spec, chat, template, trust_remote_code, field))
    with np.load(path, allow_pickle=False) as z:
        flat, lengths, prompts, info = z["tokens"], z["lengths"], z["prompt_lengths"], z["info"]
    ends = np.cumsum(lengths)
    tokens = [flat[e - n : e].tolist() for e, n in zip(ends, lengths)]
    return Samples(tokens, prompts.tolist(), bool(info[0]), int(info[1]))


def _save(path: Path, samples: Samples) -> None:
    """The samples as plain int64 arrays in one ``.npz`` (no pickled object), written atomically."""
    with atomic_writer(path) as f:
        np.savez(
            f,
            tokens=np.asarray([i for t in samples.tokens for i in t], dtype="<i8"),
            lengths=np.asarray([len(t) for t in samples.tokens], dtype="<i8"),
            prompt_lengths=np.asarray(samples.prompt_lengths, dtype="<i8"),
            info=np.asarray([int(samples.chat), samples.ended], dtype="<i8"),
        )


def generated_stream(
    checkpoint: str,
    tokenizer,
    spec: GenerateSpec,
    chat: bool,
    template: str | None = None,
    trust_remote_code: bool = False,
    field: str = "data.source",
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(tokens, targets, counts)``: the samples as one token stream (``torch.long``) with its targets (-100 on the
    prompts and on an appended EOS: see the module's doc) and the counts the data line prints."""
    s = generated_samples(checkpoint, tokenizer, spec, chat, template, trust_remote_code, field)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    targets: list[int] = []
    for sample, prompt in zip(s.tokens, s.prompt_lengths):
        ids += sample
        targets += [IGNORE] * prompt + sample[prompt:]
        if eos is not None and sample[-1] != eos:
            ids.append(eos)
            targets.append(IGNORE)
    counts = {
        "samples": len(s.tokens),
        "tokens": len(ids),
        "trained_tokens": sum(t != IGNORE for t in targets),
        "ended": s.ended,
        "chat": s.chat,
    }
    return torch.tensor(ids, dtype=torch.long), torch.tensor(targets, dtype=torch.long), counts


def describe(counts: dict, length: int) -> str:
    """The data line printed at preparation."""
    kind = "answers to chat-templated prompts" if counts["chat"] else "text from a random first token (LLM-QAT)"
    return (
        f"data: {counts['samples']:,} samples of the FP model's own {kind}, {counts['tokens']:,} tokens, "
        f"{counts['trained_tokens']:,} trained; {counts['ended']:,} ended by the model before {length} tokens"
    )


def device_kind() -> str:
    """Where the samples are drawn: the GPU when there is one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_identity(resolved: str) -> list:
    """What identifies the model's weights: its ``config.json``'s content and each weight file's path, size and mtime
    (a local directory); its id (a hub model)."""
    path = Path(resolved)
    if not path.is_dir():
        return ["hub", resolved]
    config = path / "config.json"
    out: list = [hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None]
    for f in sorted(path.iterdir()):
        if f.is_file() and f.suffix in (".safetensors", ".bin", ".pt", ".pth"):
            st = f.stat()
            out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def sample_key(resolved: str, tokenizer, spec: GenerateSpec, chat: bool, template: str | None) -> str:
    """The cache's name: changes with the model's files, the tokenizer, the template, the prompts and the settings."""
    used = (template if template is not None else getattr(tokenizer, "chat_template", None)) if chat else None
    blob = json.dumps(
        [
            FORMAT,
            model_identity(resolved),
            tokenizer_fingerprint(tokenizer),
            asdict(spec),
            chat,
            hashlib.sha256(json.dumps(used, sort_keys=True).encode()).hexdigest(),
            PROMPTS if chat else GREEDY_TOKENS,
            BATCH,
            device_kind(),
        ]
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def load_model(resolved: str, trust_remote_code: bool):
    """The FP model that samples (float32, eval mode), loaded as every stage loads it."""
    return load_model_and_tokenizer(resolved, trust_remote_code)[0]


def _prompts(tokenizer, spec: GenerateSpec, chat: bool, template: str | None, field: str, generator):
    """``(context, stored)`` per sample: the ids the model reads before sampling, and the part of them the sample
    keeps (its prompt: all of the templated user turn; in text mode the first token, without the BOS before it)."""
    if chat:
        rendered = [
            generation_prompt(tokenizer, [{"role": "user", "content": p}], template, "data.chat_template")
            for p in PROMPTS
        ]
        longest = max(len(r) for r in rendered)
        if longest >= spec.length:
            raise UserError(
                f"{field} {GENERATED}: the chat template's prompts take up to {longest} tokens, leaving no room for "
                f"an answer in data.seq_len + 1 = {spec.length} tokens",
                fix=f"raise data.seq_len to {longest} or more, or set data.format: text",
            )
        order: list[int] = []
        while len(order) < spec.samples:  # every prompt once before any twice
            order += torch.randperm(len(PROMPTS), generator=generator).tolist()
        return [(rendered[i], rendered[i]) for i in order[: spec.samples]]
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    ordinary = torch.tensor([i for i in range(len(tokenizer)) if i not in special], dtype=torch.long)
    if len(ordinary) == 0:
        raise UserError(f"{field} {GENERATED}: the tokenizer has no ordinary token to start a sample with")
    firsts = ordinary[torch.randint(len(ordinary), (spec.samples,), generator=generator)].tolist()
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [(bos + [t], [t]) for t in firsts]


class GreedyStart:
    """A logits processor for ``generate``: the first ``n`` tokens after column ``start`` are the top-1 choice (every
    other score -inf, so sampling picks it)."""

    def __init__(self, start: int, n: int):
        self.start, self.n = start, n

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] - self.start >= self.n:
            return scores
        top = scores.argmax(-1, keepdim=True)
        return torch.full_like(scores, float("-inf")).scatter(-1, top, scores.gather(-1, top))


def _generate(resolved, tokenizer, spec: GenerateSpec, chat: bool, template, trust_remote_code, field) -> Samples:
    from transformers import GenerationConfig, LogitsProcessorList

    stats["builds"] += 1
    generator = torch.Generator().manual_seed(spec.seed)
    prompts = _prompts(tokenizer, spec, chat, template, field, generator)
    eos = tokenizer.eos_token_id
    stops = sorted({*(end_of_turn_ids(tokenizer, template) if chat else []), *([eos] if eos is not None else [])})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    device = device_kind()
    model = load_model(resolved, trust_remote_code).to(device)
    model.generation_config = GenerationConfig()  # none of the checkpoint's sampling defaults: its own distribution
    tokens, prompt_lengths, ended = [], [], 0
    what = "answers to chat-templated prompts" if chat else "text samples (LLM-QAT)"
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
        torch.manual_seed(spec.seed)  # generate's sampling draws from the global generator
        for start in bar(
            range(0, spec.samples, BATCH),
            f"sampling {spec.samples} {what} of up to {spec.length} tokens from the FP model",
            unit="batch",
        ):
            batch = prompts[start : start + BATCH]
            width = max(len(context) for context, _ in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (context, _) in enumerate(batch):  # left-padded: every answer starts at column ``width``
                ids[row, width - len(context) :] = torch.tensor(context)
                mask[row, width - len(context) :] = 1
            config = GenerationConfig(
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=spec.top_p,
                max_new_tokens=spec.length - min(len(stored) for _, stored in batch),  # the most room a sample has
                eos_token_id=stops or None,
                pad_token_id=pad,
            )
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    generation_config=config,
                    logits_processor=LogitsProcessorList([] if chat else [GreedyStart(width, GREEDY_TOKENS)]),
                ).cpu()
            for row, (_, stored) in enumerate(batch):
                answer = out[row, width:].tolist()[: spec.length - len(stored)]
                stop = next((i for i, t in enumerate(answer) if t in stops), None)
                if stop is not None:  # the model ended its text: what follows is padding
                    answer, ended = answer[: stop + 1], ended + 1
                tokens.append(stored + answer)
                prompt_lengths.append(len(stored))
    return Samples(tokens, prompt_lengths, chat, ended)
