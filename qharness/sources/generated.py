"""``data.source: generated``: the FP model's own text, for QAT (with distillation) or PTQ without the user's data.

An instruct model's users rarely hold its fine-tuning data. LLM-QAT (Liu et al., 2023) trains on text the FP model
samples itself; here ``data.tokenizer``'s model (linked to ``model.checkpoint``: the run's own FP model, loaded in
float32 as every stage loads it) writes ``data.generated_samples`` samples of at most ``data.seq_len + 1`` tokens
each (the length of a chat example: a block's inputs and its last target), in one of two ways:

- **chat** (the tokenizer has a chat template, or ``data.chat_template`` gives one; ``data.format`` not ``text``): a
  user turn with one of ``PROMPTS`` (generic requests, in a seeded order that goes through all of them before
  repeating one) rendered with the template and its generation prompt, then the model's answer sampled at
  temperature 1 until its end-of-turn (or EOS) token. The text is the model's own answers, in the form it was
  fine-tuned on; the prompt's tokens are not trained.
- **text** (no template, or ``data.format: text``): LLM-QAT's hybrid. The first token is drawn uniformly from the
  vocabulary's ordinary (not special or added) tokens, so the samples start apart; the next ``GREEDY_TOKENS`` are the
  model's top-1 choice (a coherent start); the rest are sampled at temperature 1 until EOS. The model reads the
  tokenizer's BOS before the first token where it has one; the stored sample starts at the first token, which is
  not trained.

This module is the source's name and settings, torch-free (the schema reads it); ``generated_cache.py`` samples,
caches and streams them.

Example::

    spec = GenerateSpec(samples=128, length=129, seed=1234)   # data.generated_samples, data.seq_len + 1, data.seed
"""

from __future__ import annotations

from dataclasses import dataclass

GENERATED = "generated"  # data.source (and calibration.source) of the model's own samples

# Generic requests for chat models, as varied in kind as an instruct model's users are.
PROMPTS = (
    "Tell me about yourself.",
    "Write a short story about a lighthouse keeper.",
    "Explain how a rainbow forms.",
    "What are some tips for learning a new language?",
    "Write a poem about autumn.",
    "Summarize the causes of the First World War.",
    "How do I make a good cup of coffee?",
    "Explain recursion to a beginner programmer.",
    "Write a Python function that reverses a string.",
    "What is the difference between weather and climate?",
    "Give me three ideas for a birthday party.",
    "Describe the water cycle.",
    "Write a polite email declining a meeting invitation.",
    "What are the benefits of regular exercise?",
    "Explain what a neural network is.",
    "How do you say 'good morning' in French, Spanish and German?",
    "Plan a three-day trip to Rome.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "What should I consider when buying a laptop?",
    "Explain the rules of chess briefly.",
    "How does compound interest work?",
    "Give me a recipe for a simple vegetable soup.",
    "What is the Pythagorean theorem?",
    "Write a limerick about a cat.",
    "How can I sleep better?",
    "Explain supply and demand.",
    "Describe a sunset to someone who has never seen one.",
    "What is photosynthesis?",
    "List five interesting facts about the ocean.",
    "Write a short dialogue between a detective and a suspect.",
    "How do vaccines work?",
)
GREEDY_TOKENS = 4  # text mode: top-1 tokens after the random first one (LLM-QAT takes 3 to 5)


@dataclass(frozen=True)
class GenerateSpec:
    """What is sampled: ``samples`` sequences of at most ``length`` tokens (prompt included), seeded by ``seed``,
    ``top_p`` of each next-token distribution kept (1.0: all of it)."""

    samples: int
    length: int
    seed: int = 1234
    top_p: float = 1.0
