"""One lm-eval model interface over every form a model takes in qharness.

``QHarnessLM`` implements lm-eval's ``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until``
over a *backend*:

* ``BatchedForward``: a no-cache model ``forward(tokens[B, T]) -> logits[B, T, V]``: the FP HF model
  (any shape) or the QAT fake-quant graph (exported with a fixed ``[B, T]``: inputs are right-padded,
  which a causal model cannot see). Requests are batched.
* ``CachedStep``: a static-KV-cache model ``step(tokens[1, n], start) -> logits[1, n, V]``: the converted
  PyTorch model (``converted_backend``: every position in one call) or the ``.pte`` through
  ``executorch.runtime`` (prefill, then one token per call).

Every backend scores through the same ``max_length`` window, so rolling perplexities are comparable.
It is registered with lm-eval as ``qharness``, for ``.pte`` files and HF directories::

    lm_eval --model qharness --model_args pte=runs/x/model.pte --tasks qharness_ppl --include_path runs/x/eval/tasks

Example::

    lm = QHarnessLM(pte_backend("runs/x/model.pte", max_length=128), tokenizer)
    lm_eval.simple_evaluate(model=lm, tasks=["qharness_ppl"], task_manager=...)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from qharness.errors import UserError
from qharness.upstream import quiet

quiet.quiet_lm_eval_git()  # lm-eval's git lookup without git's "fatal: not a git repository" (unless verbose)

Choose = Callable[[torch.Tensor], int]  # last-position logits [V] -> next token
Stop = Callable[[int, list[int]], bool]  # (request index, tokens generated so far) -> stop?


class BatchedForward:
    """A no-cache model over ``[B, T]`` batches; ``shape=(B, T)`` when the graph only takes that shape."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor], torch.Tensor],
        max_length: int,
        batch_size: int,
        shape: tuple[int, int] | None = None,
    ):
        if shape is not None and max_length > shape[1]:
            raise ValueError(f"max_length {max_length} exceeds the graph's sequence length {shape[1]}")
        self.forward, self.max_length, self.batch_size, self.shape = forward, max_length, batch_size, shape

    def logits(self, seqs: list[list[int]], last: list[int] | None = None) -> list[torch.Tensor]:
        """Every position's logits of each sequence (``last``: how many final positions are needed; all are given)."""
        out = []
        for i in range(0, len(seqs), self.batch_size):
            group = seqs[i : i + self.batch_size]
            rows, width = self.shape if self.shape else (len(group), max(map(len, group)))
            x = torch.zeros(rows, width, dtype=torch.long)
            for r, s in enumerate(group):
                x[r, : len(s)] = torch.tensor(s, dtype=torch.long)
            with torch.no_grad():
                logits = self.forward(x)
            out += [logits[r, : len(s)].float() for r, s in enumerate(group)]
        return out

    def generate(self, contexts: list[list[int]], max_new: int, choose: Choose, stop: Stop) -> list[list[int]]:
        """Batched decoding without a cache: every step re-runs the whole (short) sequence."""
        results = [[] for _ in contexts]
        for i in range(0, len(contexts), self.batch_size):
            active = list(range(i, min(i + self.batch_size, len(contexts))))
            for _ in range(max_new):
                if not active:
                    break
                last = self.logits([contexts[j] + results[j] for j in active])
                for j, lg in zip(list(active), last):
                    results[j].append(choose(lg[-1]))
                    if stop(j, results[j]):
                        active.remove(j)
        return results


class CachedStep:
    """A static-KV-cache model ``step(tokens[1, n], start) -> logits[1, n, V]`` (batch 1)."""

    def __init__(self, step: Callable[[torch.Tensor, int], torch.Tensor], max_length: int):
        self.step, self.max_length, self.batch_size = step, max_length, 1

    def logits(self, seqs: list[list[int]], last: list[int] | None = None) -> list[torch.Tensor]:
        """Every position's logits, or (``last``) those of each sequence's last ``last[i]`` positions only: a context is
        prefilled in one call, so a model returning last-token logits only (the fast path) steps token by token
        through the continuation alone (``checks.parity.tail_logits``), not through the whole sequence."""
        from qharness.checks.parity import block_logits, tail_logits

        with torch.no_grad():
            if last is None:
                return [block_logits(self.step, torch.tensor(s, dtype=torch.long)).float() for s in seqs]
            return [tail_logits(self.step, torch.tensor(s, dtype=torch.long), k).float() for s, k in zip(seqs, last)]

    def generate(self, contexts: list[list[int]], max_new: int, choose: Choose, stop: Stop) -> list[list[int]]:
        results = []
        with torch.no_grad():
            for j, ctx in enumerate(contexts):
                logits, out = self.step(torch.tensor([ctx], dtype=torch.long), 0)[0], []
                for k in range(max_new):
                    out.append(choose(logits[-1].float()))
                    if stop(j, out) or k == max_new - 1:
                        break
                    logits = self.step(torch.tensor([[out[-1]]], dtype=torch.long), len(ctx) + k)[0]
                results.append(out)
        return results


def pte_backend(path: str | Path, max_length: int | None = None) -> CachedStep:
    """The ``.pte`` through ``executorch.runtime``; ``max_length`` defaults to the cache size minus one."""
    from qharness.runtime.pte import PteModel

    pte = PteModel(path)
    cache = int(pte.metadata().get("get_max_context_len", 0)) or None
    if max_length is None:
        if cache is None:
            raise UserError(f"{path} has no get_max_context_len method", fix="pass max_length")
        max_length = cache - 1
    if cache is not None and max_length >= cache:
        raise UserError(
            f"max_length={max_length} does not fit the .pte's KV cache of {cache} positions",
            fix=f"use max_length <= {cache - 1}",
        )
    return CachedStep(pte, max_length)


def converted_backend(graph, max_length: int) -> CachedStep:
    """A deploy graph ``(tokens[1, n], input_pos[1]) -> logits`` (the converted PyTorch model), scored through
    its all-logits twin (``fastpath.all_logits_twin``: the same weights and ops): one call per sequence, where
    a last-token graph takes one call per token."""
    from qharness.deploy.fastpath.twin import all_logits_twin

    scorer = all_logits_twin(graph)
    return CachedStep(lambda tokens, start: scorer(tokens, torch.tensor([start], dtype=torch.long)), max_length)


def hf_backend(model, max_length: int, batch_size: int = 8) -> BatchedForward:
    """An eager HF causal LM (any batch and length)."""
    model.eval()
    return BatchedForward(lambda x: model(input_ids=x).logits, max_length, batch_size)


class QHarnessLM(LM):
    """lm-eval's model interface over a ``BatchedForward`` or ``CachedStep`` backend and an HF tokenizer.

    ``prefix_id`` (BOS, else EOS) conditions the first token of a document, as lm-eval's HF model does.
    ``chat_template`` (a Jinja template; None: the tokenizer's own) renders lm-eval's chat histories when it runs
    with ``apply_chat_template`` (``apply_chat_template``, ``chat_template``, ``tokenizer_name``).
    """

    def __init__(self, backend, tokenizer, seed: int = 1234, chat_template: str | None = None):
        super().__init__()
        self.backend, self.tokenizer, self.template = backend, tokenizer, chat_template
        self.prefix_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if self.prefix_id is None:
            raise UserError("the tokenizer has neither a BOS nor an EOS token to start documents with")
        self.eos_id = tokenizer.eos_token_id
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def max_length(self) -> int:
        return self.backend.max_length

    @property
    def tokenizer_name(self) -> str:
        """Names the tokenizer in lm-eval's request caches."""
        return str(getattr(self.tokenizer, "name_or_path", "") or "qharness").replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template chat histories are rendered with: the given one, else the tokenizer's."""
        return self.template or getattr(self.tokenizer, "chat_template", None)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """lm-eval's chat history (system instruction, few-shot turns, the question) as one prompt string; without
        ``add_generation_prompt`` the last (assistant) message is continued, as lm-eval's HF model does."""
        return self.tokenizer.apply_chat_template(
            chat_history,
            chat_template=self.chat_template(),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def tok_encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Trailing spaces of the context move to the continuation; the split follows the joint encoding."""
        if not context:
            return [self.prefix_id], self.tok_encode(continuation)
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return ctx, whole[len(ctx) :]

    def _score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        """Sum of log-probabilities of each continuation given its context, and whether greedy decoding picks it.

        The input is the last ``max_length`` tokens of context + continuation (the left is cut).
        """
        inputs, conts = [], []
        for ctx, cont in pairs:
            cont = cont[-self.max_length :]
            inputs.append((ctx + cont)[-(self.max_length + 1) : -1])
            conts.append(cont)
        order = sorted(range(len(pairs)), key=lambda i: -len(inputs[i]))  # similar lengths share a batch
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        bs = self.backend.batch_size
        for start in tqdm(range(0, len(order), bs), disable=disable_tqdm, desc="loglikelihood", leave=False):
            idx = order[start : start + bs]
            scored = self.backend.logits([inputs[i] for i in idx], last=[len(conts[i]) for i in idx])
            for i, logits in zip(idx, scored):
                cont = torch.tensor(conts[i], dtype=torch.long)
                if cont.numel() == 0:
                    continue
                logp = F.log_softmax(logits[-cont.numel() :], dim=-1)
                score = logp.gather(-1, cont[:, None]).sum().item()
                results[i] = (score, bool((logp.argmax(-1) == cont).all()))
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*req.args) for req in requests]
        out = self._score(pairs, disable_tqdm)
        for req, answer in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood over disjoint windows of ``max_length`` predicted tokens, each
        conditioned on the token before it (lm-eval's rolling windows with ``context_len=1``)."""
        windows, owner = [], []
        for n, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0])
            for w in get_rolling_token_windows(tokens, self.prefix_id, self.max_length, 1):
                windows.append(make_disjoint_window(w))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (score, _) in zip(owner, self._score(windows, disable_tqdm)):
            totals[n] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _chooser(self, kwargs: dict) -> Choose:
        temperature = float(kwargs.get("temperature", 0.0) or 0.0)
        if not kwargs.get("do_sample", False) or temperature <= 0.0:
            return lambda logits: int(logits.argmax())
        top_k, top_p = int(kwargs.get("top_k", 0) or 0), float(kwargs.get("top_p", 1.0) or 1.0)

        def sample(logits: torch.Tensor) -> int:
            logits = logits / temperature
            if top_k > 0:
                logits = logits.masked_fill(logits < logits.topk(min(top_k, logits.numel())).values[-1], float("-inf"))
            probs = logits.softmax(-1)
            if top_p < 1.0:
                sorted_p, sorted_i = probs.sort(descending=True)
                drop = sorted_p.cumsum(-1) - sorted_p > top_p
                probs = probs.scatter(0, sorted_i[drop], 0.0)
            return int(torch.multinomial(probs, 1, generator=self.generator))

        return sample

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy or sampled (``do_sample``, ``temperature``, ``top_k``, ``top_p``) generation of at most
        ``max_gen_toks`` tokens, cut at the first stop sequence (``until``) or EOS. The context keeps its
        last ``max_length - max_gen_toks`` tokens."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        out = [""] * len(requests)
        for idx in tqdm(groups.values(), disable=disable_tqdm, desc="generate_until", leave=False):
            kwargs = dict(requests[idx[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = max(1, min(int(kwargs.get("max_gen_toks", 256)), self.max_length - 1))
            keep = self.max_length - max_new
            contexts = [(self.tok_encode(requests[i].args[0]) or [self.prefix_id])[-keep:] for i in idx]

            def stop(j: int, tokens: list[int], until=until) -> bool:
                return tokens[-1] == self.eos_id or any(
                    s in self.tokenizer.decode(tokens, skip_special_tokens=True) for s in until
                )

            generated = self.backend.generate(contexts, max_new, self._chooser(kwargs), stop)
            for i, tokens in zip(idx, generated):
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                for s in until:
                    text = text.split(s)[0]
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out


@register_model("qharness")
class RegisteredQHarnessLM(QHarnessLM):
    """``lm_eval --model qharness --model_args pte=PATH[,tokenizer=DIR,max_length=N]`` or ``pretrained=HF_DIR``.

    The tokenizer defaults to ``tokenizer/`` beside the ``.pte``, or the HF directory itself.
    """

    def __init__(
        self,
        pte: str | None = None,
        pretrained: str | None = None,
        tokenizer: str | None = None,
        max_length: int | None = None,
        batch_size: int | str | None = None,
        seed: int = 1234,
        **_,
    ):
        from transformers import AutoTokenizer

        if (pte is None) == (pretrained is None):
            raise UserError("model_args need exactly one of pte=PATH or pretrained=HF_DIR")
        if pte is not None:
            backend = pte_backend(pte, None if max_length is None else int(max_length))
            tok_dir = tokenizer or Path(pte).parent / "tokenizer"
        else:
            from qharness.sources.models import load_model_and_tokenizer

            model, _tok = load_model_and_tokenizer(pretrained)
            context = getattr(model.config.get_text_config(), "max_position_embeddings", 2048)
            backend = hf_backend(
                model, int(max_length or context), int(batch_size) if str(batch_size or "").isdigit() else 8
            )
            tok_dir = tokenizer or pretrained
        super().__init__(backend, AutoTokenizer.from_pretrained(tok_dir), seed=int(seed))
