"""Training tokens that need no download: the Python standard library's own source, as bytes.

``stdlib_corpus()`` reads every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` in sorted
order (a few tens of MB on any CPython) and splits it by file into a training and a held-out part
(every ``EVAL_EVERY``-th file is held out). Tokens are the bytes themselves (vocabulary 256), so the
loss of a byte-level model is real language-model loss on real text (code, comments, docstrings)
and loss curves of different runs can be compared.

``TokenBatches`` draws [B, S + 1] windows at random offsets from one generator: the same seed gives
the same batches in every precision mode; ranks of a data-parallel group pass ``rank`` to draw
disjoint streams. ``RandomTokens`` is uniform noise of the same shapes (throughput only: its loss
cannot fall below ln 256).
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass

import torch

EVAL_EVERY = 20
DEFAULT_MAX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Corpus:
    """train, held_out: uint8 [N] byte streams; files: how many source files were read."""

    train: torch.Tensor
    held_out: torch.Tensor
    files: int


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES, root: str | None = None) -> Corpus:
    """Read the standard library's .py files (sorted; reading stops after the file that reaches
    ``max_bytes``) -> Corpus."""
    root = root or sysconfig.get_paths()["stdlib"]
    paths = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__"))
        paths += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
    train, held, total = [], [], 0
    for i, p in enumerate(paths):
        try:
            with open(p, "rb") as f:
                b = f.read()
        except OSError:
            continue
        (held if i % EVAL_EVERY == EVAL_EVERY - 1 else train).append(b)
        total += len(b)
        if total >= max_bytes:
            break
    if not held or sum(map(len, held)) < 2**16:
        raise RuntimeError(f"stdlib_corpus: found too little Python source under {root!r} "
                           f"({total} bytes in {len(paths)} files)")
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(train), as_tensor(held), len(train) + len(held))


class TokenBatches:
    """Random [B, S + 1] windows of a uint8 stream -> (ids int64 [B, S], targets int64 [B, S]) on ``device``."""

    def __init__(self, stream: torch.Tensor, seq: int, seed: int, rank: int = 0, device=None):
        if stream.numel() <= seq + 1:
            raise ValueError(f"TokenBatches: a stream of {stream.numel()} tokens is too short for windows of {seq + 1}")
        self.stream, self.seq, self.device = stream, seq, device
        self.gen = torch.Generator().manual_seed(seed * 7919 + rank)

    def next(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.randint(0, self.stream.numel() - self.seq - 1, (batch, 1), generator=self.gen)
        w = self.stream[start + torch.arange(self.seq + 1)].long()
        w = w.pin_memory() if self.device is not None and torch.device(self.device).type == "cuda" else w
        w = w.to(self.device, non_blocking=True)
        return w[:, :-1], w[:, 1:]


class RandomTokens:
    """Uniform random tokens in [0, vocab): (ids, targets) int64 [B, S] on ``device``."""

    def __init__(self, vocab: int, seq: int, seed: int, rank: int = 0, device=None):
        self.vocab, self.seq, self.device = vocab, seq, device
        self.gen = torch.Generator().manual_seed(seed * 7919 + rank)

    def next(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randint(0, self.vocab, (batch, self.seq + 1), generator=self.gen).to(self.device)
        return w[:, :-1], w[:, 1:]


__all__ = ["Corpus", "RandomTokens", "TokenBatches", "stdlib_corpus"]
