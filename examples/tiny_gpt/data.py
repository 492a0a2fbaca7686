# SPDX-License-Identifier: Apache-2.0
"""A text corpus the project generates itself, a byte-level tokenizer and a windowed dataset.

The corpus is English-like prose from a built-in vocabulary and a handful of sentence templates,
drawn from a seeded ``random.Random``: the same seed gives the same bytes on every machine and
Python version that keeps ``random``'s documented reproducibility. The default corpus is about
300 KB and builds in well under a second; nothing is downloaded.

Batches: each :class:`TokenDataset` item is a LongTensor of ``seq_len + 1`` byte ids, so a
DataLoader with the default collate (or ``deepspeed.initialize(training_data=...)``) yields a
LongTensor of shape (micro_batch, seq_len + 1). The training loop splits it into inputs and
next-token targets and passes both to the engine::

    inputs, targets = split_batch(batch.to(engine.device))
    loss = engine(inputs, targets)   # GPT.forward returns the mean cross-entropy
    engine.backward(loss)
    engine.step()
"""

import functools
import random

import torch
from torch.utils.data import Dataset

__all__ = ["VOCAB_SIZE", "TokenDataset", "build_corpus", "decode", "encode", "split_batch"]

VOCAB_SIZE = 256  # byte-level: every byte value is a token, so any text encodes

_NAMES = ("Alice", "Bruno", "Chen", "Dana", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Luis",
          "Maya", "Noor", "Oskar", "Priya")
_NOUNS = ("river", "garden", "teacher", "machine", "window", "letter", "mountain", "kitchen", "engine", "bird",
          "lantern", "market", "child", "doctor", "bridge", "forest", "song", "train", "island", "painter",
          "clock", "village", "storm", "library", "farmer", "ship", "candle", "road", "student", "castle",
          "horse", "mirror", "baker", "cloud", "door", "field")
_PLACES = ("the old harbour", "the city square", "the quiet valley", "the train station", "the north tower",
           "the small cafe", "the riverbank", "the school yard", "the market hall", "the hill road")
_ADJECTIVES = ("quiet", "bright", "old", "tired", "small", "golden", "heavy", "careful", "green", "strange",
               "warm", "patient", "broken", "clever", "distant", "gentle", "noisy", "empty", "proud", "narrow")
_ADVERBS = ("slowly", "quickly", "carefully", "again", "at noon", "in the rain", "before dawn", "without a word",
            "every morning", "once more", "by accident", "with great care")
_PREPOSITIONS = ("near", "behind", "under", "beside", "across", "inside", "above", "towards")
# (base, third person singular, past): irregular forms written out rather than derived.
_VERBS = (("see", "sees", "saw"), ("find", "finds", "found"), ("carry", "carries", "carried"),
          ("watch", "watches", "watched"), ("build", "builds", "built"), ("paint", "paints", "painted"),
          ("follow", "follows", "followed"), ("open", "opens", "opened"), ("leave", "leaves", "left"),
          ("repair", "repairs", "repaired"), ("draw", "draws", "drew"), ("visit", "visits", "visited"),
          ("forget", "forgets", "forgot"), ("clean", "cleans", "cleaned"), ("sell", "sells", "sold"),
          ("remember", "remembers", "remembered"), ("move", "moves", "moved"), ("hear", "hears", "heard"))
_INTRANSITIVE = (("wait", "waits", "waited"), ("sleep", "sleeps", "slept"), ("sing", "sings", "sang"),
                 ("laugh", "laughs", "laughed"), ("run", "runs", "ran"), ("rest", "rests", "rested"),
                 ("sit", "sits", "sat"), ("fall", "falls", "fell"))


def _noun_phrase(rng):
    noun = rng.choice(_NOUNS)
    if rng.random() < 0.5:
        noun = f"{rng.choice(_ADJECTIVES)} {noun}"
    return f"{rng.choice(('the', 'the', 'a', 'this', 'that', 'every'))} {noun}"


def _sentence(rng):
    """One sentence from one of eight templates; subjects are names or noun phrases."""
    subject = rng.choice(_NAMES) if rng.random() < 0.4 else _noun_phrase(rng)
    verb = rng.choice(_VERBS)
    still = rng.choice(_INTRANSITIVE)
    kind = rng.randrange(8)
    if kind == 0:
        text = f"{subject} {verb[2]} {_noun_phrase(rng)} {rng.choice(_PREPOSITIONS)} {_noun_phrase(rng)}."
    elif kind == 1:
        text = f"{subject} {verb[1]} {_noun_phrase(rng)} {rng.choice(_ADVERBS)}."
    elif kind == 2:
        text = f"{subject} {still[2]} {rng.choice(_PREPOSITIONS)} {rng.choice(_PLACES)}."
    elif kind == 3:
        text = f"{rng.choice(_NAMES)} and {rng.choice(_NAMES)} {verb[2]} {_noun_phrase(rng)} {rng.choice(_ADVERBS)}."
    elif kind == 4:
        text = f"Why does {_noun_phrase(rng)} {still[0]} {rng.choice(_ADVERBS)}?"
    elif kind == 5:
        text = f"{rng.choice(_NAMES)} said that {_noun_phrase(rng)} was {rng.choice(_ADJECTIVES)}."
    elif kind == 6:
        text = f"In {rng.choice(_PLACES)}, {subject} {verb[1]} {_noun_phrase(rng)}."
    else:
        text = f"{subject} did not {verb[0]} {_noun_phrase(rng)}, so {_noun_phrase(rng)} {still[2]}."
    return text[0].upper() + text[1:]


def build_corpus(num_sentences=6000, seed=0):
    """Generated English-like text: ``num_sentences`` sentences in paragraphs of 3-7 sentences.

    About 50 bytes a sentence, so the default is about 300 KB. ASCII only.
    """
    rng = random.Random(seed)
    paragraphs, done = [], 0
    while done < num_sentences:
        count = min(rng.randint(3, 7), num_sentences - done)
        paragraphs.append(" ".join(_sentence(rng) for _ in range(count)))
        done += count
    return "\n".join(paragraphs) + "\n"


def encode(text):
    """Text -> LongTensor of byte ids (UTF-8)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(tokens):
    """Byte ids (any integer sequence or tensor) -> text; invalid UTF-8 is replaced, not raised."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def split_batch(batch):
    """(micro_batch, seq_len + 1) windows -> (inputs, targets), each (micro_batch, seq_len)."""
    return batch[:, :-1], batch[:, 1:]


@functools.lru_cache(maxsize=4)
def _corpus_tokens(num_sentences, seed):
    # Cached: every rank and every dataset in a process shares one encoded corpus.
    return encode(build_corpus(num_sentences, seed))


class TokenDataset(Dataset):
    """``num_samples`` windows of ``seq_len + 1`` tokens from the generated corpus.

    Args:
        seq_len: model context; each item has ``seq_len + 1`` tokens (inputs plus the shifted target).
        num_samples: dataset length. Window starts are drawn uniformly from the corpus by a
            generator seeded with ``seed``, so the same arguments give the same items everywhere.
        seed: chooses the windows (default 0).
        corpus_sentences, corpus_seed: the corpus (``build_corpus`` arguments; defaults 6000, 0).

    Item ``i`` is a LongTensor of shape (seq_len + 1,); use :func:`split_batch` on a collated batch.
    """

    def __init__(self, seq_len=128, num_samples=1024, seed=0, corpus_sentences=6000, corpus_seed=0):
        if seq_len < 1 or num_samples < 1:
            raise ValueError(f"seq_len and num_samples must be >= 1, got {seq_len} and {num_samples}")
        self.seq_len = seq_len
        self.tokens = _corpus_tokens(corpus_sentences, corpus_seed)
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(f"corpus of {len(self.tokens)} tokens is too short for seq_len {seq_len}")
        generator = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(self.tokens) - seq_len, (num_samples, ), generator=generator)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, index):
        start = int(self.starts[index])
        # clone: a view would pin (and, through DataLoader workers, ship) the whole corpus storage.
        return self.tokens[start:start + self.seq_len + 1].clone()
