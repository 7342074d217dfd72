"""A byte-level BPE tokenizer trained on given text (the embedded default's, and tests' tiny models')."""

from __future__ import annotations

EOS = "<|endoftext|>"


def train_bpe_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE trained with ``tokenizers``, wrapped as a ``PreTrainedTokenizerFast``.

    ``<|endoftext|>`` is BOS, EOS and PAD; prompts start with BOS (a template post-processor, which
    ExecuTorch's LLM runner also reads from ``tokenizer.json``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", special_tokens=[(EOS, eos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)
